// attnres/report.hpp — the comparison report: results.json -> report.md and PNG plots.
//
// `attnres compare` writes RUN_DIR/results.json (every number of the comparison); everything
// else in the report is generated from it, so `attnres report RUN_DIR` can regenerate it.
#pragma once

#include <cstddef>
#include <string>

namespace attnres {

// The largest results.json read (a comparison of many runs' curves is a few MiB).
constexpr size_t kMaxResultsBytes = size_t{256} << 20;

// Writes RUN_DIR/report.md from RUN_DIR/results.json (atomically). Throws Error naming the file
// if results.json is missing or malformed.
void write_report(const std::string& run_dir);

// Renders the plots (val_loss.png, output_rms.png, grad_norm.png, depth_weights_<group>.png)
// into RUN_DIR with Python 3 and matplotlib (Debian python3-matplotlib), from results.json.
// Returns false and sets *why (e.g. "python3-matplotlib is not installed; apt-get install
// python3-matplotlib") when they cannot be drawn; the report then says so.
bool render_plots(const std::string& run_dir, std::string* why);

}  // namespace attnres
