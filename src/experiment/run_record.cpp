#include "experiment/run_record.hpp"

#include <omp.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <limits>
#include <optional>
#include <sstream>

#include "attnres/data.hpp"
#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/model.hpp"
#include "attnres/safetensors.hpp"
#include "core/json_field.hpp"
#include "train/run_dir.hpp"

namespace fs = std::filesystem;
using nlohmann::json;

namespace attnres::experiment {

RunMetrics read_metrics(const fs::path& metrics, int64_t skip_from, int64_t skip_to) {
  RunMetrics m;
  std::vector<int64_t> steps;  // of the curve's points, while every line gives one
  if (!fs::exists(metrics)) return m;
  int64_t at = 0;  // where the line starts in the file
  // Streamed line by line: a huge metrics.jsonl is never held whole.
  for_each_line(metrics.string(), kMaxMetricsLine, [&](std::string_view line, int64_t n, bool cut) {
    const int64_t start = at;
    at += static_cast<int64_t>(line.size()) + 1;  // (the newline)
    if (start >= skip_from && start < skip_to) return;
    if (line.empty()) return;
    const std::string where = "'" + metrics.string() + "' line " + std::to_string(n);
    check(!cut, where + " is longer than any metrics line (" +
                    std::to_string(kMaxMetricsLine >> 20) +
                    " MiB): the file is damaged; delete that run's directory to train it again");
    json j;
    try {
      j = parse_json(line);
    } catch (const json::exception& e) {
      throw Error(where + " is not valid JSON (" + e.what() +
                  "); delete that run's directory to train it again");
    }
    if (!j.is_object()) return;
    if (j.contains("val_loss")) {
      // A resumed run repeats the steps after its checkpoint, and logs their evaluations again:
      // the later line replaces every point from that step on (the curve had a point twice, and
      // the seeds' mean curve, averaged by position, was shifted; fifteenth hostile pass).
      const json step = j.value("step", json(nullptr));
      const int64_t s =
          step.is_number_integer() ? step.get<int64_t>() : std::numeric_limits<int64_t>::min();
      while (step.is_number_integer() && !steps.empty() && steps.back() >= s) {
        steps.pop_back();
        m.curve.erase(m.curve.size() - 1);
      }
      steps.push_back(s);
      m.curve.push_back(
          {j.value("tokens", json(nullptr)), j["val_loss"], j.value("elapsed_s", json(nullptr))});
    } else if (j.contains("loss") && !j.contains("skipped")) {
      m.last_train_loss = j["loss"];
      m.last_tokens_per_s = j.value("tokens_per_s", json(nullptr));
    }
    if (j.value("kind", "") == "diagnostics") m.diagnostics = j;
  });
  return m;
}

// What a run's train_config.json records that is not a setting of its model or training.
constexpr std::array<const char*, 7> kNoSettings = {
    "out_dir", "data_dir", "log_every", "save_every", "keep_checkpoints", "parallel", "sample"};

json run_settings(const TrainConfig& c, int64_t vocab) {
  TrainConfig r = c;
  r.model.vocab_size = vocab;
  r.model.max_seq_len = r.seq_len;
  r.model.resolve();
  json j = json::parse(r.to_json());
  for (const char* k : kNoSettings) j.erase(k);
  return j;
}

namespace {

// The settings in which `have` differs from `want`, e.g. "steps, lr" ("" when none).
std::string differing(const json& have, const json& want) {
  std::string out;
  auto add = [&](const std::string& k) { out += (out.empty() ? "" : ", ") + k; };
  for (const auto& [k, v] : want.items()) {
    if (!have.is_object() || !have.contains(k)) {
      add(k);
    } else if (have[k] != v) {
      if (v.is_object() && have[k].is_object()) {
        const std::string sub = differing(have[k], v);
        add(k + " (" + sub + ")");
      } else {
        add(k);
      }
    }
  }
  // A setting recorded only where it is not the default (runtime: absent for the CPU in fp32) is
  // a difference too: a bf16 run was kept by an fp32 command (fifteenth hostile pass).
  // (The keys run_settings leaves out are no settings.)
  if (have.is_object()) {
    for (const auto& [k, v] : have.items()) {
      if (!want.contains(k) &&
          std::find(kNoSettings.begin(), kNoSettings.end(), k) == kNoSettings.end()) {
        add(k);
      }
    }
  }
  return out;
}

}  // namespace

namespace {
// The options that give a recorded runtime ("--device cpu --precision bf16"); "" for none.
std::string runtime_options(const json& settings) {
  const auto rt = settings.find("runtime");
  if (rt == settings.end() || !rt->is_object()) return "--device cpu --precision fp32";
  std::string out;
  for (const char* k : {"device", "precision"}) {
    if (rt->contains(k) && (*rt)[k].is_string()) {
      out += std::string(out.empty() ? "" : " ") + "--" + k + " " + (*rt)[k].get<std::string>();
    }
  }
  if (rt->value("cuda_graphs", false)) out += " --cuda-graphs";
  return out;
}
}  // namespace

void check_same_settings(const json& have, const json& want, const fs::path& dir,
                         const char* what) {
  const std::string diff = differing(have, want);
  // (where the runtime alone differs, the options that continue the kept runs; fifteenth pass)
  const std::string how = have.is_object() && diff == "runtime"
                              ? " (the runs there trained with " + runtime_options(have) +
                                    ": give those options to continue them)"
                              : "";
  check(diff.empty(), "'" + (dir / what).string() +
                          "' was made with other settings than this "
                          "command's (" +
                          diff + " differ)" + how + "; use a new --out, or delete '" +
                          dir.string() + "' to train it again");
}

namespace {
// {"w": [[weight or null, ...], ...], ...}: the depth-weight table the diagnostics write.
bool depth_weights_shaped(const json& d) {
  if (!d.is_object() || !d.contains("w") || !d["w"].is_array()) return false;
  for (const json& row : d["w"]) {
    if (!row.is_array()) return false;
    for (const json& x : row) {
      if (!x.is_number() && !x.is_null()) return false;
    }
  }
  return true;
}

// A kept run's record has the fields (and types) the comparison reads from it; valid JSON of
// another shape gave `internal error` (sixteenth hostile pass).
void check_run_shape(const json& r, uint64_t seed, const fs::path& path, const fs::path& dir) {
  std::string bad;
  auto need = [&](bool ok, const char* what) {
    if (!ok && bad.empty()) bad = what;
  };
  auto number_or_null = [&](const char* k) {
    return !r.contains(k) || r[k].is_number() || r[k].is_null();
  };
  need(r.is_object(), "not a JSON object");
  if (bad.empty()) {
    need(r.contains("group") && r["group"].is_string(), "no 'group' name");
    need(r.contains("seed") && r["seed"].is_number_unsigned() && r["seed"].get<uint64_t>() == seed,
         "no 'seed', or another seed than its directory's");
    need(!r.contains("status") ||
             (r["status"].is_string() && (r["status"] == "ok" || r["status"] == "diverged")),
         "a 'status' other than ok or diverged");
    need(!r.contains("dir") || r["dir"].is_string(), "a 'dir' that is not a path");
    for (const char* k : {"final_val_loss", "final_train_loss", "tokens_per_s", "seconds"}) {
      need(number_or_null(k), "a figure that is not a number");
    }
    // (read whole by the results and the analysis: a missing or mistyped one was an internal
    // error; eighteenth hostile pass)
    for (const char* k : {"final_val_loss", "tokens_per_s"})
      need(r.contains(k), "a figure missing");
    need(r.contains("params") && r["params"].is_number_integer(), "no 'params' count");
    need(r.contains("flops_per_token") && r["flops_per_token"].is_number(),
         "no 'flops_per_token' figure");
    need(r.contains("init_hash") && r["init_hash"].is_string(), "no 'init_hash' fingerprint");
    need(!r.contains("batch_hash") || r["batch_hash"].is_string() || r["batch_hash"].is_null(),
         "a 'batch_hash' that is not a fingerprint");
    need(!r.contains("model_checksum") || r["model_checksum"].is_string(),
         "a 'model_checksum' that is not a checksum");
    for (const char* k : {"settings", "tasks"}) {
      need(!r.contains(k) || r[k].is_object(), "'settings' or 'tasks' not an object");
    }
    if (r.contains("tasks") && r["tasks"].is_object()) {
      for (const auto& [name, t] : r["tasks"].items())
        need(t.is_object(), "a task score not an object");
    }
    need(!r.contains("diagnostics") || r["diagnostics"].is_object() || r["diagnostics"].is_null(),
         "'diagnostics' not an object");
    if (r.contains("diagnostics") && r["diagnostics"].is_object() &&
        r["diagnostics"].contains("depth_weights")) {
      need(depth_weights_shaped(r["diagnostics"]["depth_weights"]),
           "'diagnostics.depth_weights' not a table of weights");
    }
    need(!r.contains("curve") || r["curve"].is_array(), "a 'curve' that is not a list");
  }
  check(bad.empty(), "'" + path.string() + "' is not the record of a run of this comparison (" +
                         bad + "): it was edited or replaced; delete '" + dir.string() +
                         "' to train it again");
}
}  // namespace

namespace {
constexpr const char* kRecordKey = "record_fnv1a64";

// The fingerprint of a record: of its JSON text without the fingerprint's own field (an object's
// keys are sorted, and numbers are printed to round-trip, so the text is the same after a read).
std::string record_fingerprint(json rj) {
  rj.erase(kRecordKey);
  return hex64(fnv1a64(rj.dump()));
}
}  // namespace

void write_run_record(const fs::path& path, json& rj) {
  rj[kRecordKey] = record_fingerprint(rj);
  write_file_atomic(path.string(), rj.dump() + "\n");
}

json kept_run(const TrainConfig& c, int64_t vocab, const std::string& group, const fs::path& out) {
  const fs::path dir = c.out_dir;
  const fs::path path = dir / "run.json";
  json kept;
  try {
    kept =
        parse_json(read_small_file(path.string(), kMaxRunRecordBytes, "a comparison's run.json"));
  } catch (const json::exception& e) {
    throw Error("'" + path.string() + "' is not valid JSON (" + e.what() + "); delete '" +
                dir.string() + "' to train it again");
  }
  check_run_shape(kept, c.seed, path, dir);
  // Its figures are the ones compare measured and wrote: an edited loss, speed or task score was
  // reported and flipped a verdict (nineteenth hostile pass).
  check(kept.contains(kRecordKey) && kept[kRecordKey].is_string() &&
            kept[kRecordKey].get<std::string>() == record_fingerprint(kept),
        "'" + path.string() +
            "' is not as compare wrote it (edited since, or an older version's record without "
            "its fingerprint): its figures would be reported unmeasured; delete '" +
            dir.string() + "' to train it again");
  // The record of this very run: another configuration's (or a path outside the comparison)
  // had its model scored and its figures reported as this one's (seventeenth hostile pass).
  const std::string rel = fs::relative(dir, out).string();
  // (a record without its directory is this one's: the tasks scored the comparison's root
  // directory's model for it; eighteenth hostile pass)
  if (!kept.contains("dir")) kept["dir"] = rel;
  check(kept["group"] == group && kept["dir"] == rel,
        "'" + path.string() + "' is the record of another run (group '" +
            kept["group"].get<std::string>() + "', directory '" + kept["dir"].get<std::string>() +
            "'), not of '" + group + "' in '" + rel + "': it was copied or edited; delete '" +
            dir.string() + "' to train it again");
  if (kept.contains("settings")) {
    check_same_settings(kept["settings"], run_settings(c, vocab), dir, "run.json");
  }
  // The run's own train_config.json says what it trained, and what the model beside it is (a
  // record without settings kept a 2-step run in a 20-step comparison; another run's model and
  // configuration copied in beside a record were scored as its run's; 17th and 18th passes).
  const fs::path tc = dir / "train_config.json";
  json have;
  try {
    have =
        parse_json(read_small_file(tc.string(), kMaxTrainConfigBytes, "a run's train_config.json"));
  } catch (const std::exception& e) {
    throw Error("'" + tc.string() + "' cannot say what the run kept in '" + dir.string() +
                "' trained (" + e.what() + "); delete '" + dir.string() + "' to train it again");
  }
  check_same_settings(have, run_settings(c, vocab), dir, "train_config.json");
  // And its final model is there, the one it recorded (a deleted or swapped model was kept as
  // "already done"; twentieth hostile pass).
  if (kept.contains("model_checksum")) {
    const fs::path model = dir / "model.safetensors";
    std::string sum;
    try {
      const SafetensorsReader file = SafetensorsReader::open(model.string());
      const auto it = file.metadata().find(kDataChecksumKey);
      if (it != file.metadata().end()) sum = it->second;
    } catch (const Error& e) {
      throw Error("the run kept in '" + dir.string() + "' has lost its final model (" + e.what() +
                  "); restore it, or delete '" + dir.string() + "' to train the run again");
    }
    check_recorded_model(kept, sum, model, dir);
  }
  return kept;
}

void check_recorded_model(const json& run, const std::string& sum, const fs::path& model,
                          const fs::path& dir) {
  check(!run.contains("model_checksum") || run["model_checksum"] == sum,
        "'" + model.string() +
            "' is not the final model its run recorded (another checkpoint or run copied over "
            "it?); restore it, or delete '" +
            dir.string() + "' to train the run again");
}

bool prepare_run_dir(const TrainConfig& c, int64_t vocab) {
  const fs::path dir = c.out_dir;
  const bool resume = fs::exists(dir / "latest") && fs::exists(dir / "train_config.json");
  if (!resume) {  // a run that had not saved a checkpoint starts again in a clean place
    std::error_code ec;
    const fs::file_status st = fs::symlink_status(dir, ec);
    if (!fs::exists(st)) return false;
    check(fs::is_directory(st), "'" + dir.string() +
                                    "', where this comparison keeps a run, is not a directory "
                                    "(a file or a link of yours?); move it away and rerun");
    { const RunLock live(dir.string()); }  // (a train running there now: refused, with its pid)
    const std::string n = first_stranger_in_run_dir(dir.string());
    check(n.empty(), "'" + (dir / n).string() +
                         "' is in the place of an unfinished run of this comparison, but no "
                         "run writes it; it is left alone: move it away (or delete '" +
                         dir.string() + "') and rerun");
    fs::remove_all(dir, ec);
    return false;
  }
  json have;  // an interrupted run continues only under the same settings
  try {
    have = parse_json(read_small_file((dir / "train_config.json").string(), kMaxTrainConfigBytes,
                                      "a run's train_config.json"));
  } catch (const json::exception& e) {
    throw Error("'" + (dir / "train_config.json").string() + "' is not valid JSON (" + e.what() +
                "); delete '" + dir.string() + "' to train it again");
  }
  check_same_settings(have, run_settings(c, vocab), dir, "train_config.json");
  return true;
}

RunOutcome train_run(const TrainConfig& c, const TrainEvents& ev) {
  RunOutcome o;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    o.result = train(c, ev);
  } catch (const DivergedError& e) {
    o.diverged = e.what();
  }
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return o;
}

json run_record(const std::string& group, const TrainConfig& c, int64_t vocab, const fs::path& out,
                const RunOutcome& o) {
  const fs::path dir = c.out_dir;
  const TrainResult& r = o.result;
  const bool ok = o.diverged.empty();
  // A resumed run's earlier figures come from its log: only one that still holds what the run
  // had logged at its checkpoint (an edited log's speed, curve and diagnostics were signed into
  // the results as measured; twenty-first hostile pass).
  check(!c.resume || !ok || r.log_intact,
        "'" + (dir / "metrics.jsonl").string() +
            "' does not begin with what that run had logged when its checkpoint was saved "
            "(edited or replaced since, or saved by an older attnres), and its run.json is gone: "
            "its curve and speed cannot be taken as measured; delete '" +
            dir.string() + "' to train that run again");
  const RunMetrics rm = read_metrics(dir / "metrics.jsonl", r.log_skip_from, r.log_skip_to);
  // Fingerprints of the initial shared weights and the batch order.
  uint64_t init_hash = r.init_hash;
  int64_t params = r.num_params;
  double flops_per_token = r.flops_per_token;
  if (c.resume || !ok) {
    ModelConfig mc = c.model;
    mc.vocab_size = vocab;
    mc.max_seq_len = c.seq_len;
    mc.resolve();
    Model m(mc);
    m.init_weights(c.seed);
    init_hash = m.shared_weights_hash();
    params = m.num_params();
    flops_per_token = train_flops_per_token(mc, c.seq_len);
  }
  auto opt_num = [](const std::optional<double>& x, const json& fallback) {
    return x ? json(*x) : fallback;
  };
  json rj = {{"group", group},
             {"seed", c.seed},
             {"dir", fs::relative(dir, out).string()},
             {"status", ok ? "ok" : "diverged"},
             {"final_val_loss", ok ? opt_num(r.final_val_loss, nullptr) : json(nullptr)},
             {"final_train_loss", opt_num(r.final_train_loss, rm.last_train_loss)},
             {"tokens_per_s", opt_num(r.tokens_per_s, rm.last_tokens_per_s)},
             {"threads", omp_get_max_threads()},           // (the speed's; its last invocation's)
             {"seconds", ok ? r.run_seconds : o.seconds},  // (every call's, on a resume)
             {"skipped_steps", ok ? json(r.skipped_steps) : json(nullptr)},
             {"params", params},
             {"flops_per_token", flops_per_token},
             {"init_hash", std::to_string(init_hash)},
             {"batch_hash", ok ? json(std::to_string(r.batch_hash)) : json(nullptr)},
             {"settings", run_settings(c, vocab)},
             {"curve", rm.curve},
             {"diagnostics", rm.diagnostics}};
  if (!ok) rj["reason"] = o.diverged;
  // The final model's checksum: --tasks scores that model and no other (an earlier checkpoint
  // copied over it was scored as the run's; nineteenth hostile pass).
  const fs::path model = dir / "model.safetensors";
  std::error_code ec;
  if (ok && fs::exists(model, ec)) {
    const SafetensorsReader file = SafetensorsReader::open(model.string());
    const auto it = file.metadata().find(kDataChecksumKey);
    if (it != file.metadata().end()) rj["model_checksum"] = it->second;
  }
  return rj;
}

}  // namespace attnres::experiment
