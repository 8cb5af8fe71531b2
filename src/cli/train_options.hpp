// Options shared by `attnres train` and `attnres compare`.
#pragma once

#include <CLI/CLI.hpp>
#include <atomic>
#include <optional>
#include <string>
#include <vector>

#include "attnres/checkpoint.hpp"
#include "attnres/data.hpp"
#include "attnres/train.hpp"

namespace attnres::cli {

struct TrainArgs {
  TrainArgs();  // defaults, e.g. the corpus of Debian's fortunes package
  TrainConfig cfg;
  bool untied = false;
  int64_t sample_tokens = 200;
  std::string prompt = "The ";
  // On --resume, which of --pipeline, --virtual-stages, --pipeline-comm and --zero1 were given
  // (the others are the run's recorded ones where the rank count is the same: adopt_saved_layout).
  struct LayoutGiven {
    bool pipeline = false, virtual_stages = false, pipeline_comm = false, zero1 = false,
         grad_bucket = false;
  } layout_given;
  // Applies the flags that are not TrainConfig fields (call before using cfg).
  void finalize();
};

// Registers every data, model, residual, optimiser and evaluation option on s, bound to a.
void add_train_options(CLI::App* s, TrainArgs& a);

// Parses training options (e.g. {"--block-size=4"}) into a, leaving other fields as they are.
// Throws Error on an unknown option or a bad value.
void apply_train_args(TrainArgs& a, const std::vector<std::string>& args);

// On --resume a run continues with the settings it started with (out_dir/train_config.json). A
// training option given now (on the command line or in --config) with another value than the
// saved one would be dropped without a word: Error naming each, with the saved and the given
// value. The same values, and the options of how to run (--device, --precision, --cuda-graphs:
// not saved), pass.
void check_resume_options(const CLI::App& s, const std::string& out_dir);

// On --resume, --device, --precision and --cuda-graphs not given on s are the run's own (its
// train_config.json "runtime"), so the printed resume command continues the run as it started.
void apply_saved_runtime(const CLI::App& s, TrainArgs& a);

// On --resume launched on as many ranks as the run recorded: each of its pipeline layout and
// --zero1 (train_config.json "parallel") not given now (a.layout_given), so that a plain resume
// continues exactly as it ran and one given option changes that one only. On another rank count
// nothing changes (the trainer notes the new layout).
void adopt_saved_layout(TrainArgs& a, int64_t ranks);

// A new run from --init-from CKPT takes the checkpoint's model (sizes, norms, RoPE, residual
// mode) and its tokenizer (byte, or its SentencePiece model as --tokenizer-model) for every
// option not given on s; the given ones win. A checkpoint without a config changes nothing.
void apply_init_from_defaults(const CLI::App& s, TrainArgs& a);

// SIGINT/SIGTERM/SIGUSR1/SIGHUP set the returned flag (a second one exits at once), SIGPIPE is
// ignored; remove restores the
// default action (terminate).
// Blocks SIGINT/SIGTERM/SIGUSR1/SIGHUP in every thread and starts the one thread that receives
// them; main() calls it before any other thread exists. Without an installed stop handler a signal
// terminates the process as by default.
void start_signal_thread();
const std::atomic<bool>* install_stop_handler();
// How often the process was continued after a stop (Ctrl-Z, SIGSTOP): TrainEvents::continued.
// Call it from the training thread only (it takes the pending SIGCONTs).
uint64_t continue_counter();
void remove_stop_handler();

// The corpus of the run in `run_dir` (its train_config.json `t`), read as training read it, for
// eval and inspect without --data. Error when the text is no longer the one the run trained on
// (its fingerprint): the "validation split" would then hold training text.
Corpus read_trained_corpus(const TrainConfig& t, const std::string& run_dir);

// The settings of the run `model` belongs to (the train_config.json beside it, or two levels up
// for a step checkpoint RUN/checkpoints/step_N/), or nothing when there is none; *run_dir (if
// given) gets that run's directory. Error when the model records another run's settings (a model
// copied into another run's directory: that run's corpus and split say nothing held-out about it).
std::optional<TrainConfig> run_config_beside(const std::string& model, const Metadata& meta,
                                             std::string* run_dir = nullptr);

}  // namespace attnres::cli
