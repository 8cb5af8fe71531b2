// Model and optimizer checkpoints on top of the safetensors reader/writer.
#include "attnres/checkpoint.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "attnres/data.hpp"
#include "attnres/error.hpp"
#include "attnres/fileio.hpp"

namespace attnres {

namespace {
constexpr const char* kModelFormat = "attnres-model/1";
constexpr const char* kOptimFormat = "attnres-optim/1";
}  // namespace

namespace {

// Throws Error(what: the tensor ...; fix) naming the first tensor of `layout` (its name after
// `prefix`) that holds a non-finite value in x, and how many it holds; `nonneg`: negative values
// too (Adam's v).
void check_finite(const float* x, const ParamLayout& layout, const std::string& prefix,
                  const std::string& what, const std::string& fix, bool nonneg = false) {
  for (const ParamEntry& e : layout.entries()) {
    int64_t bad = 0;
    for (int64_t i = 0; i < e.numel; i++) {
      const float v = x[e.offset + i];
      bad += !std::isfinite(v) || (nonneg && v < 0.0f);
    }
    if (bad > 0) {
      throw Error(what + ": tensor '" + prefix + e.name + "' holds " + std::to_string(bad) +
                  " of " + std::to_string(e.numel) +
                  (nonneg ? " values that are negative or not finite" : " non-finite values") +
                  " (NaN or Inf); " + fix);
    }
  }
}

// The integer a metadata value holds (decimal digits only), in [0, max]; else an Error.
int64_t metadata_count(const std::string& v, int64_t max, const std::string& what) {
  const bool digits =
      !v.empty() && v.size() <= 18 && v.find_first_not_of("0123456789") == std::string::npos;
  const int64_t n = digits ? std::stoll(v) : -1;
  check(digits && n <= max, what + " is '" + v + "', not a count in [0, " + std::to_string(max) +
                                "]; the checkpoint's metadata is corrupt or was edited");
  return n;
}

}  // namespace

bool is_attnres_checkpoint(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(std::filesystem::symlink_status(path, ec))) return false;
  try {
    const SafetensorsReader r = SafetensorsReader::open(path);
    auto f = r.metadata().find("format");
    return f != r.metadata().end() && f->second.rfind("attnres-model/", 0) == 0;
  } catch (const Error&) {
    return false;
  }
}

bool has_attnres_model_header(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(std::filesystem::symlink_status(path, ec))) return false;
  try {
    const int fd = open_regular_file(path, O_RDONLY, "read");
    std::string head(8, '\0');
    uint64_t n = 0;
    bool ok = ::read(fd, head.data(), 8) == 8;
    if (ok) std::memcpy(&n, head.data(), 8);
    ok = ok && n >= 2 && n <= (uint64_t{1} << 20);  // (a model's header: a few KiB)
    std::string header(ok ? n : 0, '\0');
    ok = ok && ::read(fd, header.data(), n) == static_cast<ssize_t>(n);
    ::close(fd);
    if (!ok) return false;
    const auto j = nlohmann::json::parse(header, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("__metadata__") || !j["__metadata__"].is_object()) {
      return false;
    }
    const auto& f = j["__metadata__"].value("format", nlohmann::json());
    return f.is_string() && f.get<std::string>().rfind("attnres-model/", 0) == 0;
  } catch (const Error&) {
    return false;
  }
}

std::string checkpoint_tokenizer_file(const Metadata& meta, const std::string& path) {
  auto ref = meta.find("tokenizer");
  if (ref == meta.end() || ref->second.find(':') == std::string::npos) return "";
  const std::string dir = std::filesystem::path(path).parent_path().string();
  return join_path(dir.empty() ? "." : dir, ref->second.substr(ref->second.find(':') + 1));
}

std::unique_ptr<Tokenizer> load_checkpoint_tokenizer(const Metadata& meta, const std::string& path,
                                                     int64_t vocab_size) {
  auto ref = meta.find("tokenizer");
  const std::string r = ref == meta.end() ? "byte" : ref->second;
  const std::string dir = std::filesystem::path(path).parent_path().string();
  auto tok = load_tokenizer(r, dir, vocab_size);
  auto want = meta.find(kTokenizerHashKey);
  if (want != meta.end()) {
    const std::string got = hex64(fnv1a64(tok->model_data()));
    check(got == want->second,
          "tokenizer '" + checkpoint_tokenizer_file(meta, path) + "' is not the one '" + path +
              "' was saved with (fingerprint " + got + ", the " + "checkpoint's " + want->second +
              "): another tokenizer of the same vocabulary would read the text as other tokens. "
              "Restore the checkpoint's own copy (each checkpoints/step_N/ of its run holds one)");
  }
  return tok;
}

int64_t checkpoint_step(const Metadata& meta, int64_t max_step, const std::string& path) {
  auto it = meta.find("step");
  check(it != meta.end(), "checkpoint '" + path +
                              "' has no 'step' in its metadata; it is not a "
                              "training checkpoint of attnres");
  return metadata_count(it->second, max_step, "checkpoint '" + path + "': its step");
}

void check_weights_finite(const Model& model, const std::string& what, const std::string& fix) {
  std::vector<float> host;
  check_finite(model.params_on_host(host), model.layout(), "", what, fix);
}

void save_model(const std::string& path, const Model& model, const Metadata& meta) {
  SafetensorsWriter w;
  for (const auto& [k, v] : meta) w.set_metadata(k, v);
  w.set_metadata("format", kModelFormat);
  w.set_metadata("config", model.config().to_json());
  // A model on a device is written from a host copy.
  std::vector<float> host;
  const float* p = model.params_on_host(host);
  for (const ParamEntry& e : model.layout().entries()) w.add_f32(e.name, e.shape, p + e.offset);
  w.write(path);
}

void load_weights(Model& model, const SafetensorsReader& r, bool allow_extra) {
  // A model on a device is read into a host copy, uploaded once every tensor checked out.
  std::vector<float> host;
  float* p = model.params_stage(host);
  std::set<std::string> expected;
  for (const ParamEntry& e : model.layout().entries()) {
    expected.insert(e.name);
    if (!r.has(e.name)) {
      throw Error("checkpoint '" + r.path() + "' has no tensor '" + e.name +
                  "' that this model configuration needs; was it saved with a different "
                  "config (tied/untied head, residual mode, layer count)?");
    }
    r.read_f32(e.name, e.shape, p + e.offset);
  }
  check_finite(p, model.layout(), "", "checkpoint '" + r.path() + "' is unusable",
               "the run diverged or the file is corrupt: use an earlier checkpoint of its run "
               "(its checkpoints/ directory), or train again");
  if (!allow_extra) {
    for (const std::string& n : r.names()) {
      if (!expected.count(n)) {
        throw Error("checkpoint '" + r.path() + "' has tensor '" + n +
                    "' that this model configuration does not; the file's config and its "
                    "tensors disagree (re-save the checkpoint)");
      }
    }
  }
  model.commit_params(host);
}

namespace {

std::string num(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%.9g", x);
  return b;
}

// Settings of `to` that differ from `from` and change the model's function but no tensor shape.
std::vector<std::string> function_changes(const ModelConfig& from, const ModelConfig& to) {
  std::vector<std::string> v;
  auto add = [&](const char* what, const std::string& a, const std::string& b) {
    if (a != b) v.push_back(std::string(what) + " " + a + " -> " + b);
  };
  add("norm_eps", num(from.norm_eps), num(to.norm_eps));
  add("rope_theta", num(from.rope_theta), num(to.rope_theta));
  const ResidualConfig &a = from.residual, &b = to.residual;
  if (a.is_attnres() && b.is_attnres()) {
    add("attnres key eps", num(from.key_norm_eps()), num(to.key_norm_eps()));
    add("attnres temperature", num(a.temperature), num(b.temperature));
    add("attnres gate", to_string(a.gate), to_string(b.gate));
    add("attnres heads", std::to_string(a.heads), std::to_string(b.heads));
    add("attnres window", std::to_string(a.window), std::to_string(b.window));
    add("block size", std::to_string(a.effective_block_size()),
        std::to_string(b.effective_block_size()));
  }
  return v;
}

}  // namespace

int64_t load_initial_weights(Model& model, const std::string& path,
                             std::vector<std::string>* changed) {
  const SafetensorsReader r = SafetensorsReader::open(path);
  if (auto it = r.metadata().find("config"); it != r.metadata().end()) {
    ModelConfig from;
    try {
      from = ModelConfig::from_json(it->second);
      from.validate();
    } catch (const Error& e) {
      throw Error("--init-from '" + path + "': " + e.what());
    }
    if (changed) *changed = function_changes(from, model.config());
  }
  std::vector<float> p = model.params_to_host();
  std::set<std::string> expected;
  int64_t kept = 0;
  const auto& entries = model.layout().entries();
  for (size_t k = 0; k < entries.size(); k++) {
    const ParamEntry& e = entries[k];
    expected.insert(e.name);
    if (!r.has(e.name)) {
      if (k >= model.core_entries()) {
        kept++;
        continue;
      }
      // (a Hugging Face export's weights named only the missing tensor; 24th hostile pass)
      check(!r.has("model.embed_tokens.weight"),
            "--init-from '" + path +
                "' holds a Hugging Face model's weights (its tensor names), not an attnres "
                "checkpoint: convert its directory with `attnres import-hf DIR --out "
                "model.safetensors` and start from that");
      throw Error("--init-from '" + path + "' has no tensor '" + e.name +
                  "' that this model "
                  "needs; give a checkpoint of the same size (layers, width, heads, vocabulary, "
                  "tied or untied head)");
    }
    r.read_f32(e.name, e.shape, p.data() + e.offset);
  }
  check_finite(p.data(), model.layout(), "", "--init-from '" + path + "'",
               "the checkpoint is unusable");
  for (const std::string& n : r.names()) {
    if (!expected.count(n)) {
      throw Error("--init-from '" + path + "' has tensor '" + n +
                  "' that this model does not "
                  "(another residual mode, or another size); train with the checkpoint's own "
                  "--residual and model options");
    }
  }
  model.params_from_host(p.data());
  return kept;
}

std::unique_ptr<Model> load_model(const std::string& path, Metadata* meta, int64_t max_seq_len,
                                  std::shared_ptr<Backend> be) {
  SafetensorsReader r = SafetensorsReader::open(path);
  auto it = r.metadata().find("config");
  if (it == r.metadata().end()) {
    // (a Hugging Face model's weights were answered with `attnres train`; 22nd hostile pass)
    const bool hf = r.has("model.embed_tokens.weight") || r.has("lm_head.weight");
    const bool adam = !hf && r.metadata().count("adam_steps") > 0;
    throw Error("'" + path +
                "' has no model config in its __metadata__ (key 'config'); it is not "
                "an attnres checkpoint. " +
                (hf     ? std::string("It looks like a Hugging Face model's weights: convert its "
                                          "directory with `attnres import-hf DIR --out OUT`.")
                 : adam ? std::string("It looks like a checkpoint's optimizer state: name the "
                                      "model.safetensors beside it.")
                        : std::string("Train one with `attnres train`, or convert a Hugging Face "
                                      "model with `attnres import-hf`.")));
  }
  ModelConfig cfg;
  try {
    cfg = ModelConfig::from_json(it->second);
    if (max_seq_len > 0) cfg.max_seq_len = max_seq_len;
    cfg.validate();
  } catch (const Error& e) {
    throw Error("checkpoint '" + path + "': " + e.what());
  }
  // Check every tensor the config implies against the file before allocating anything, so a
  // config claiming a huge model fails here instead of allocating it (the tensors' byte ranges
  // were already checked against the file size).
  const ParamLayout expected = Model::layout_for(cfg);
  for (const ParamEntry& e : expected.entries()) {
    if (!r.has(e.name)) {
      throw Error("checkpoint '" + path + "' has no tensor '" + e.name +
                  "' that its config needs; the config in its metadata and its tensors disagree, "
                  "or it was saved by another program (re-save the checkpoint)");
    }
    const TensorInfo& ti = r.info(e.name);
    if (ti.shape != e.shape) {
      throw Error("checkpoint '" + path + "': tensor '" + e.name + "' has shape " +
                  shape_str(ti.shape) + " but its config needs " + shape_str(e.shape) +
                  "; the config in its metadata and its tensors disagree (re-save the checkpoint)");
    }
  }
  auto model = std::make_unique<Model>(cfg, std::move(be));
  load_weights(*model, r);
  if (meta) *meta = r.metadata();
  return model;
}

void save_optimizer(const std::string& path, const Model& model, AdamW& opt, const Metadata& meta) {
  check(!opt.sharded(), "internal: save_optimizer needs the whole optimizer state, not a shard");
  SafetensorsWriter w;
  for (const auto& [k, v] : meta) w.set_metadata(k, v);
  w.set_metadata("format", kOptimFormat);
  w.set_metadata("adam_steps", std::to_string(opt.steps_taken()));
  const bool host = opt.m().backend() == nullptr;  // else written from host copies (a device)
  const std::vector<float> hm = host ? std::vector<float>() : opt.m().download();
  const std::vector<float> hv = host ? std::vector<float>() : opt.v().download();
  const float* m = host ? opt.m().data() : hm.data();
  const float* v = host ? opt.v().data() : hv.data();
  for (const ParamEntry& e : model.layout().entries()) {
    w.add_f32("m." + e.name, e.shape, m + e.offset);
    w.add_f32("v." + e.name, e.shape, v + e.offset);
  }
  w.write(path);
}

Metadata load_optimizer(const std::string& path, const Model& model, AdamW& opt) {
  check(!opt.sharded(), "internal: load_optimizer needs the whole optimizer state, not a shard");
  SafetensorsReader r = SafetensorsReader::open(path);
  auto fmt = r.metadata().find("format");
  auto steps = r.metadata().find("adam_steps");
  if (fmt == r.metadata().end() || fmt->second != kOptimFormat || steps == r.metadata().end()) {
    throw Error("'" + path + "' is not an attnres optimizer state (format '" +
                std::string(kOptimFormat) + "' expected)");
  }
  const bool host = opt.m().backend() == nullptr;  // else read into host copies, then uploaded
  std::vector<float> hm(host ? 0 : opt.m().size()), hv(host ? 0 : opt.v().size());
  for (const ParamEntry& e : model.layout().entries()) {
    for (const char* k : {"m.", "v."}) {
      const std::string n = k + e.name;
      if (!r.has(n)) {
        throw Error("optimizer state '" + path + "' has no tensor '" + n +
                    "'; it belongs to a different model configuration");
      }
      float* dst = (k[0] == 'm' ? (host ? opt.m().data() : hm.data())
                                : (host ? opt.v().data() : hv.data())) +
                   e.offset;
      r.read_f32(n, e.shape, dst);
    }
  }
  const std::string unusable = "optimizer state '" + path + "' is unusable",
                    fix = "the file is corrupt: resume from an earlier checkpoint of the run";
  check_finite(host ? opt.m().data() : hm.data(), model.layout(), "m.", unusable, fix);
  check_finite(host ? opt.v().data() : hv.data(), model.layout(), "v.", unusable, fix, true);
  if (!host) {
    opt.m().upload(hm.data(), hm.size());
    opt.v().upload(hv.data(), hv.size());
  }
  opt.set_steps_taken(metadata_count(steps->second, int64_t{1} << 40,
                                     "optimizer state '" + path + "': its adam_steps"));
  return r.metadata();
}

namespace {

std::optional<double> held_out_share(const std::string& s) {
  char* end = nullptr;
  const double x = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || *end != '\0' || !(x > 0 && x < 1)) return std::nullopt;
  return x;
}

}  // namespace

std::vector<TrainedOn> trained_on(const Metadata& meta) {
  std::vector<TrainedOn> out;
  const auto f = meta.find(kCorpusHashKey), v = meta.find(kValFractionKey);
  auto tk = meta.find(kValTokenizerKey);
  if (tk == meta.end()) tk = meta.find(kTokenizerHashKey);  // (recorded by earlier builds)
  if (f != meta.end() && v != meta.end() && !f->second.empty()) {
    if (const auto x = held_out_share(v->second)) {
      out.push_back({f->second, *x, tk == meta.end() ? std::string() : tk->second});
    }
  }
  const auto a = meta.find(kAncestryKey);
  if (a == meta.end()) return out;
  const auto j = nlohmann::json::parse(a->second, nullptr, /*allow_exceptions=*/false);
  if (!j.is_array()) return out;
  for (const auto& e : j) {
    if (!e.is_object() || !e.contains("corpus_fnv1a64") || !e.contains("val_fraction") ||
        !e["corpus_fnv1a64"].is_string() || !e["val_fraction"].is_number()) {
      continue;
    }
    const double x = e["val_fraction"].get<double>();
    const std::string fp = e["corpus_fnv1a64"].get<std::string>();
    const auto t = e.find("tokenizer_fnv1a64");
    const std::string tok = t != e.end() && t->is_string() ? t->get<std::string>() : "";
    if (x > 0 && x < 1 && !fp.empty()) out.push_back({fp, x, tok});
  }
  return out;
}

bool share_counts_alike(const TrainedOn& t, const std::string& tokenizer) {
  return t.tokenizer.empty() || t.tokenizer == tokenizer;
}

const TrainedOn* share_of_another_tokenizer(const std::vector<TrainedOn>& shares,
                                            const std::string& corpus,
                                            const std::string& tokenizer) {
  for (const TrainedOn& t : shares) {
    if (t.fingerprint == corpus && !share_counts_alike(t, tokenizer)) return &t;
  }
  return nullptr;
}

std::string ancestry_from(const Metadata& from) {
  nlohmann::json j = nlohmann::json::array();
  for (const TrainedOn& t : trained_on(from)) {
    nlohmann::json e = {{"corpus_fnv1a64", t.fingerprint}, {"val_fraction", t.val_fraction}};
    if (!t.tokenizer.empty()) e["tokenizer_fnv1a64"] = t.tokenizer;
    if (std::find(j.begin(), j.end(), e) == j.end()) j.push_back(e);  // (once each)
  }
  return j.empty() ? std::string() : j.dump();
}

Metadata training_record(const Metadata& meta) {
  Metadata out;
  for (const char* k : {kCorpusHashKey, kValFractionKey, kValTokenizerKey, kAncestryKey}) {
    if (const auto it = meta.find(k); it != meta.end()) out[k] = it->second;
  }
  return out;
}

}  // namespace attnres
