// Options that do nothing in the configuration given. Taken without a word they mislead (a user
// believes a run used them): hostile passes 21-24 found them one command at a time, so train and
// compare share this one table.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "attnres/train.hpp"

namespace attnres::cli {

struct InertOption {
  std::string option;  // as given, e.g. "--block-size"
  std::string why;     // what it sets, why it does nothing here, and the fix
};

// The options given on s (command line or --config) that do nothing in the run cfg describes.
std::vector<InertOption> inert_options(const CLI::App& s, const TrainConfig& cfg);

}  // namespace attnres::cli
