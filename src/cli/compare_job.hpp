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

}  // namespace attnres::cli
