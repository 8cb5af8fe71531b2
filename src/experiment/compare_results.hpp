// A comparison's results.json (format attnres-compare/2): its setup, one row per configuration
// (means over the finished runs, the difference of means to the baseline configuration), every
// run's record, whether the runs of one seed shared initial weights and batches, and the reading
// (report/analysis: paired differences, best per mode, the paper's claims).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "attnres/train.hpp"

namespace attnres::experiment {

struct Configuration {
  std::string name;
  TrainConfig cfg;                                  // its residual mode in cfg.model.residual
  nlohmann::json sweep = nlohmann::json::object();  // swept option -> value
};

struct ResultsInput {
  std::string command_line, preset;
  double wall_time_s = 0.0;  // this command's
  int64_t kept_runs = 0;     // runs finished by an earlier command and kept (not timed in wall)
  TrainConfig base;          // the settings every configuration shares (steps, batch, data, ...)
  std::string tokenizer_ref;
  int64_t vocab = 0, train_tokens = 0, val_tokens = 0;
  std::vector<Configuration> configs;
  int64_t seeds = 1;    // seeds base.seed, base.seed + 1, ...
  nlohmann::json runs;  // the run.json records (experiment/run_record.hpp)
};

// The baseline configuration of the difference column: the PreNorm configuration when there is
// exactly one, else the first configuration.
std::string baseline_of(const std::vector<Configuration>& configs);

nlohmann::json assemble_results(const ResultsInput& in);

// Writes results.json `path` (atomically) with "results_fnv1a64", a fingerprint of what the
// comparison measured (the whole but the analysis and the plots note, which `report` redraws),
// set in `results` too.
void write_results(const std::string& path, nlohmann::json& results);
// Whether results.json `results` (read from `path`) carries its fingerprint; Error naming the
// file when it does and its figures no longer match it (edited since: a figure nobody measured
// would be drawn).
bool check_results_fingerprint(const nlohmann::json& results, const std::string& path);

}  // namespace attnres::experiment
