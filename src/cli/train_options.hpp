// Options shared by `attnres train` and `attnres compare`.
#pragma once

#include <CLI/CLI.hpp>
#include <atomic>
#include <string>

#include "attnres/train.hpp"

namespace attnres::cli {

struct TrainArgs {
  TrainConfig cfg;
  bool untied = false;
  int64_t sample_tokens = 200;
  std::string prompt = "The ";
  // Applies the flags that are not TrainConfig fields (call before using cfg).
  void finalize() { cfg.model.tied = !untied; }
};

// Registers every data, model, residual, optimiser and evaluation option on s, bound to a.
void add_train_options(CLI::App* s, TrainArgs& a);

// SIGINT/SIGTERM set the returned flag (a second one exits at once); remove restores defaults.
const std::atomic<bool>* install_stop_handler();
void remove_stop_handler();

}  // namespace attnres::cli
