// One run of a comparison on disk (`attnres compare`, `scale`): what its metrics.jsonl holds, the
// settings that decide its result, the check that a kept or resumed run was made with the
// command's settings, and its run.json record, which holds only what was measured.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "attnres/train.hpp"

namespace attnres::experiment {

// What a run's metrics.jsonl holds over all its invocations: the validation curve ([tokens,
// val loss, training seconds or null]), the last diagnostics, and the last logged training loss
// and throughput (null if none was logged). Error naming the file and line on invalid JSON.
struct RunMetrics {
  nlohmann::json curve = nlohmann::json::array();
  nlohmann::json diagnostics = nullptr;
  nlohmann::json last_train_loss = nullptr, last_tokens_per_s = nullptr;
};
// Lines that start in bytes [skip_from, skip_to) are skipped (TrainResult::log_skip_from).
RunMetrics read_metrics(const std::filesystem::path& metrics, int64_t skip_from = 0,
                        int64_t skip_to = 0);

// The settings that decide a run's result (model resolved against the vocabulary, as its
// train_config.json holds them): what a kept or resumed run must have been made with. Where the
// files go, logging and checkpointing are left out.
nlohmann::json run_settings(const TrainConfig& c, int64_t vocab);

// A kept or half-finished run made with other settings is never mixed in: Error naming the file
// `dir/what`, the settings that differ and the fix.
void check_same_settings(const nlohmann::json& have, const nlohmann::json& want,
                         const std::filesystem::path& dir, const char* what);

// A finished run kept from an earlier invocation: its run.json (in c.out_dir), checked to be the
// record of configuration `group` in the comparison `out`, made with c's settings.
nlohmann::json kept_run(const TrainConfig& c, int64_t vocab, const std::string& group,
                        const std::filesystem::path& out);

// Error unless `sum`, the data checksum (kDataChecksumKey) of the model file `model` in the run
// directory `dir`, is the one the run's record `run` kept ("model_checksum"; none kept: any):
// another checkpoint or run copied over a run's final model was kept or scored as that run's
// (nineteenth and twentieth hostile passes).
void check_recorded_model(const nlohmann::json& run, const std::string& sum,
                          const std::filesystem::path& model, const std::filesystem::path& dir);

// Makes c.out_dir ready for the run: an interrupted run there (a checkpoint and its
// train_config.json) is resumed, after checking it was made with c's settings; anything else
// there is removed. Returns whether the run resumes.
bool prepare_run_dir(const TrainConfig& c, int64_t vocab);

// How one training of the comparison ended.
struct RunOutcome {
  TrainResult result;    // (empty when it diverged)
  std::string diverged;  // the DivergedError's message; "" when it finished
  double seconds = 0.0;  // wall time of this invocation
};

// Trains c. A diverged run is a result (e.g. too high a learning rate in a sweep): returned as
// such, with no loss, so that the comparison goes on. Other errors propagate.
RunOutcome train_run(const TrainConfig& c, const TrainEvents& ev);

// The largest run.json read (a run's curve and diagnostics are well under a MiB).
constexpr size_t kMaxRunRecordBytes = size_t{64} << 20;

// Writes run.json `path` (atomically) with its fingerprint, "record_fnv1a64" (of the record
// without it), set in `rj` too: a record edited since (a figure nobody measured) is refused when
// kept.
void write_run_record(const std::filesystem::path& path, nlohmann::json& rj);

// The run.json record of configuration `group`'s run with config c (its out_dir the run's
// directory, below `out`). A resumed or diverged run's fingerprint of the initial weights is
// recomputed the way the trainer computes it (init from the seed).
nlohmann::json run_record(const std::string& group, const TrainConfig& c, int64_t vocab,
                          const std::filesystem::path& out, const RunOutcome& o);

}  // namespace attnres::experiment
