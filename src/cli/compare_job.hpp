// One comparison (`attnres compare`), as a job that `attnres scale` runs once per model size.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "cli/train_options.hpp"

namespace attnres::cli {

struct CompareArgs {
  TrainArgs base;
  std::string out = "runs/compare";
  std::string modes = "prenorm,full,block";
  int64_t seeds = 3;
  std::vector<std::string> sweeps;
  std::string preset = "small";
  bool no_plots = false;
  std::vector<std::string> tasks;  // task files scored on every finished run's model (--tasks)
  std::string command_line;
  CLI::App* app = nullptr;  // the options given on the command line (a preset fills the rest)
};

// Trains every configuration over the seeds and writes out/results.json, report.md and plots.
// Returns false when interrupted (rerunning continues); throws Error on bad options or data.
bool run_compare(CompareArgs& a);

// Error unless what compare or scale writes at the top of `out` replaces only its own earlier
// output: json_name (if present) a JSON object with json_key, md_name only beside such a file.
void check_own_outputs(const std::string& out, const char* json_name, const char* md_name,
                       const char* json_key);

// --out is neither the corpus directory --data, inside it, nor a training run's directory.
void check_out_apart_from_data(const std::string& out, const std::string& data);

}  // namespace attnres::cli
