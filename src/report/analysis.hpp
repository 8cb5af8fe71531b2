// The reading of a comparison (results.json -> its "analysis" object): which runs finished, the
// configuration each mode is judged at (its own best over a sweep), paired differences to the
// baseline over seeds with 95 % intervals and verdicts, and the paper's claims measured.
//
// Paired: the runs of one seed share initial weights and batch order, so the difference of two
// configurations is taken seed by seed, and its spread over seeds gives the interval.
#pragma once

#include <nlohmann/json.hpp>

namespace attnres::report {

// results: the object `attnres compare` writes (groups with "name", "mode", "sweep"; runs with
// "group", "seed", "status", "final_val_loss", "diagnostics"). Returns
//   {"baseline": mode, "selection": "fixed" | "best per mode",
//    "selected": {mode: group name},
//    "best_per_mode": [{"mode", "group", "sweep", "val_loss_mean", "seeds_ok"}]   (with a sweep)
//    "comparisons": [{"group", "vs", "kind", "n", "mean", "sd", "lo", "hi", "verdict"}],
//    "claims": [{"claim", "paper", "subject", "measured", "interval", "verdict", "n"}],
//    "failed_runs": [{"group", "seed", "status", "reason"}]}
// A run counts only with status "ok" (older files without a status: a numeric final_val_loss).
nlohmann::json analyze(const nlohmann::json& results);

}  // namespace attnres::report
