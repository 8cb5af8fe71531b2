// What a result records about where and when it was measured.
#pragma once

#include <string>

#include "attnres/train.hpp"

namespace attnres::experiment {

std::string cpu_name();  // /proc/cpuinfo's model name, or "unknown CPU"
std::string now_iso();   // UTC, e.g. 2026-12-01T17:00:00Z

// Seconds per optimizer step of cfg (its model resolved), timed on fixed tokens after one
// warm-up step: the best of two. For a comparison's time estimate, not a benchmark.
double time_step(const TrainConfig& cfg);

}  // namespace attnres::experiment
