// TrainConfig validation and its JSON form (train_config.json in the run directory).
#include <nlohmann/json.hpp>

#include "attnres/data.hpp"
#include "attnres/error.hpp"
#include "attnres/train.hpp"
#include "core/json_field.hpp"

namespace attnres {

void TrainConfig::validate() const {
  auto need = [](bool ok, const std::string& m) { check(ok, "invalid training setting: " + m); };
  need(bpe_vocab >= 64 && bpe_vocab <= 1000000, "--vocab-size must be in [64, 1000000]");
  need(val_fraction > 0 && val_fraction < 1, "--val-fraction must be in (0, 1)");
  need(grad_bucket_elems >= 16 && grad_bucket_elems <= (int64_t{1} << 31),
       "--grad-bucket-mib must be in (0, 8192]");
  need(tokenizer_model.empty() || tokenizer == TokenizerKind::bpe,
       "--tokenizer-model (a SentencePiece model, also taken from an --init-from checkpoint) "
       "reads text as BPE pieces: drop --tokenizer byte");
  need(batch_size >= 1 && batch_size <= 1 << 20, "--batch-size must be in [1, 1048576]");
  need(seq_len >= 1 && seq_len <= 1 << 20, "--seq-len must be in [1, 1048576]");
  need(grad_accum >= 1 && grad_accum <= 1 << 20, "--grad-accum must be in [1, 1048576]");
  need(steps >= 1 && steps <= int64_t{1} << 40, "--steps must be in [1, 2^40]");
  // (each factor is bounded above, so the product of doubles is exact enough to compare)
  need(static_cast<double>(steps) * static_cast<double>(batch_size) * static_cast<double>(seq_len) *
               static_cast<double>(grad_accum) <
           0x1p62,
       "the run's tokens (--steps x --batch-size x --seq-len x --grad-accum) must be below 2^62");
  // The optimizer computes in float: a value that rounds to 0 or 1 there is refused (--beta1
  // 0.99999999 became 1: nothing moved; --lr 1e-300 became 0).
  need(adamw.lr > 0 && adamw.lr < 10 && static_cast<float>(adamw.lr) >= 1e-30f,
       "--lr must be in [1e-30, 10)");
  // (compared as doubles first: casting a value beyond float's range is undefined behaviour)
  need(adamw.beta1 >= 0 && adamw.beta1 < 1 && static_cast<float>(adamw.beta1) < 1.0f &&
           adamw.beta2 >= 0 && adamw.beta2 < 1 && static_cast<float>(adamw.beta2) < 1.0f,
       "AdamW betas must be in [0, 1) in single precision (at most 0.99999994)");
  need(adamw.eps > 0, "AdamW eps must be > 0");
  need(adamw.weight_decay >= 0, "--weight-decay must be >= 0");
  // AdamW multiplies every decayed weight by 1 - lr x wd each step: at 1 or more it zeroes the
  // weights or flips their sign (eleventh hostile pass: 1e30 made a finite garbage model).
  need(adamw.lr * adamw.weight_decay < 1,
       "--weight-decay x --lr must be below 1 (AdamW scales each weight by 1 - lr x wd every "
       "step); lower --weight-decay");
  need(grad_clip >= 0, "--grad-clip must be >= 0 (0 disables)");
  // (eval_batches x batch_size windows: 2^61 / B overflowed and evaluated nothing, printing a
  // loss of -0.0000; eval's --batches has the same bound)
  need(eval_every >= 0 && eval_batches >= 1 && eval_batches <= int64_t{1} << 30,
       "--eval-every must be >= 0, --eval-batches in [1, 2^30]");
  need(save_every >= 0 && keep_checkpoints >= 1, "--save-every >= 0, --keep-checkpoints >= 1");
  need(log_every >= 1, "--log-every must be >= 1");
  need(!out_dir.empty(), "--out must name a run directory");
  need(pipeline >= 1, "--pipeline must be >= 1");
  need(virtual_stages >= 1, "--virtual-stages must be >= 1");
  need(ranks >= 0, "training config: parallel.ranks must be >= 0");
  need(virtual_stages == 1 || pipeline > 1,
       "--virtual-stages needs a pipeline of several ranks (--pipeline P with P >= 2)");
  need(pipeline_comm == "cached" || pipeline_comm == "naive",
       "--pipeline-comm must be 'cached' or 'naive', got '" + pipeline_comm + "'");
  need(pipeline_comm == "cached" || pipeline > 1,
       "--pipeline-comm " + pipeline_comm +
           " chooses how a pipeline sends its sources: it needs --pipeline P with P >= 2");
  const bool cpu = device == Device::cpu;
  need(!cuda_graphs || !cpu,
       "--cuda-graphs captures the step on --device cuda (or cuda-host, its emulation)");
  need(cpu || (pipeline == 1 && !zero1),
       std::string("--device ") + to_string(device) +
           " trains data-parallel only for now: drop --pipeline and --zero1 "
           "(or use --device cpu)");
  need(router_lr_mult > 0 && router_lr_mult <= 1000, "--router-lr-mult must be in (0, 1000]");
  need(router_warmup >= -1, "--router-warmup must be >= 0 (or -1: the schedule's warm-up)");
  need(cpu || (router_lr_mult == 1.0 && router_warmup == -1),
       "--router-lr-mult and --router-warmup train on --device cpu only for now");
  schedule.validate();
}

std::string TrainConfig::to_json() const {
  nlohmann::json j = {
      {"data_path", data_path},
      {"tokenizer", to_string(tokenizer)},
      {"bpe_vocab", bpe_vocab},
      {"val_fraction", val_fraction},
      {"model", nlohmann::json::parse(model.to_json())},
      {"batch_size", batch_size},
      {"seq_len", seq_len},
      {"grad_accum", grad_accum},
      {"steps", steps},
      {"lr", adamw.lr},
      {"beta1", adamw.beta1},
      {"beta2", adamw.beta2},
      {"adam_eps", adamw.eps},
      {"weight_decay", adamw.weight_decay},
      {"schedule", to_string(schedule.kind)},
      {"warmup_steps", schedule.warmup_steps},
      {"min_lr_ratio", schedule.min_lr_ratio},
      {"decay_fraction", schedule.decay_fraction},
      {"router_lr_mult", router_lr_mult},
      {"router_warmup", router_warmup},
      {"grad_clip", grad_clip},
      {"eval_every", eval_every},
      {"eval_batches", eval_batches},
      {"save_every", save_every},
      {"keep_checkpoints", keep_checkpoints},
      {"log_every", log_every},
      {"max_bad_steps", max_bad_steps},
      {"seed", seed},
      {"init_from", init_from},
      {"out_dir", out_dir},
      {"data_dir", data_dir},
      {"corpus_fingerprint", corpus_fingerprint},
      {"tokenizer_fingerprint", tokenizer_fingerprint},
  };
  if (!tokenizer_model.empty()) j["tokenizer_model"] = tokenizer_model;  // (absent in older runs)
  // Where and how it trained: runtime choices (a resume may change them, with a note), recorded so
  // that a resume without them continues as the run started. Absent for the CPU in fp32.
  if (device != Device::cpu || precision != MatmulPrecision::fp32 || cuda_graphs) {
    j["runtime"] = {{"device", to_string(device)},
                    {"precision", to_string(precision)},
                    {"cuda_graphs", cuda_graphs}};
  }
  if (sample_tokens >= 0) j["sample"] = {{"tokens", sample_tokens}, {"prompt", prompt}};
  if (ranks > 0) {
    j["parallel"] = {{"ranks", ranks},
                     {"pipeline", pipeline},
                     {"virtual_stages", virtual_stages},
                     {"pipeline_comm", pipeline_comm},
                     {"zero1", zero1},
                     {"grad_bucket_elems", grad_bucket_elems}};
    if (threads > 0) j["parallel"]["threads"] = threads;
  }
  return j.dump(2);
}

TrainConfig TrainConfig::from_json(const std::string& text) {
  TrainConfig c;
  try {
    const auto j = parse_json(text);
    check(j.is_object(), "training config must be a JSON object");
    auto get = [&](const char* k, auto& dst) {
      return read_json_field(j, k, dst, "training config");
    };
    // An enum field: its name, parsed (an unknown name is an Error naming the choices).
    auto get_named = [&](const char* k, auto& dst, auto parse) {
      std::string name = to_string(dst);
      if (get(k, name)) dst = parse(name);
    };
    get("data_path", c.data_path);
    get_named("tokenizer", c.tokenizer, parse_tokenizer_kind);
    get("bpe_vocab", c.bpe_vocab);
    get("val_fraction", c.val_fraction);
    if (j.contains("model")) c.model = ModelConfig::from_json(j.at("model").dump());
    get("batch_size", c.batch_size);
    get("seq_len", c.seq_len);
    get("grad_accum", c.grad_accum);
    get("steps", c.steps);
    get("lr", c.adamw.lr);
    get("beta1", c.adamw.beta1);
    get("beta2", c.adamw.beta2);
    get("adam_eps", c.adamw.eps);
    get("weight_decay", c.adamw.weight_decay);
    get_named("schedule", c.schedule.kind, parse_schedule_kind);
    get("warmup_steps", c.schedule.warmup_steps);
    get("min_lr_ratio", c.schedule.min_lr_ratio);
    get("decay_fraction", c.schedule.decay_fraction);
    get("router_lr_mult", c.router_lr_mult);
    get("router_warmup", c.router_warmup);
    get("grad_clip", c.grad_clip);
    get("eval_every", c.eval_every);
    get("eval_batches", c.eval_batches);
    get("save_every", c.save_every);
    get("keep_checkpoints", c.keep_checkpoints);
    get("log_every", c.log_every);
    get("max_bad_steps", c.max_bad_steps);
    get("seed", c.seed);
    get("init_from", c.init_from);
    get("out_dir", c.out_dir);
    get("data_dir", c.data_dir);
    get("corpus_fingerprint", c.corpus_fingerprint);
    get("tokenizer_fingerprint", c.tokenizer_fingerprint);
    get("tokenizer_model", c.tokenizer_model);
    if (auto rt = j.find("runtime"); rt != j.end()) {
      check(rt->is_object(), "training config: 'runtime' must be an object");
      auto get_rt = [&](const char* k, auto& dst) {
        return read_json_field(*rt, k, dst, "training config runtime");
      };
      std::string name = to_string(c.device);
      if (get_rt("device", name)) c.device = parse_device(name);
      name = to_string(c.precision);
      if (get_rt("precision", name)) c.precision = parse_precision(name);
      get_rt("cuda_graphs", c.cuda_graphs);
    }
    if (auto sa = j.find("sample"); sa != j.end()) {
      check(sa->is_object(), "training config: 'sample' must be an object");
      read_json_field(*sa, "tokens", c.sample_tokens, "training config sample");
      read_json_field(*sa, "prompt", c.prompt, "training config sample");
      check(c.sample_tokens >= 0, "training config: 'sample' records " +
                                      std::to_string(c.sample_tokens) +
                                      " tokens; a closing sample has 0 or more");
    }
    if (auto pa = j.find("parallel"); pa != j.end()) {
      check(pa->is_object(), "training config: 'parallel' must be an object");
      auto get_pa = [&](const char* k, auto& dst) {
        return read_json_field(*pa, k, dst, "training config parallel");
      };
      get_pa("ranks", c.ranks);
      get_pa("pipeline", c.pipeline);
      get_pa("virtual_stages", c.virtual_stages);
      get_pa("pipeline_comm", c.pipeline_comm);
      get_pa("zero1", c.zero1);
      get_pa("threads", c.threads);                      // (absent: an earlier version's record)
      get_pa("grad_bucket_elems", c.grad_bucket_elems);  // (absent: 16 MiB, as they ran)
      // (a damaged record is the file's fault, not an option's: said so, naming the field)
      check(c.ranks >= 1 && c.pipeline >= 1 && c.virtual_stages >= 1 && c.threads >= 0 &&
                c.grad_bucket_elems >= 16 && c.grad_bucket_elems <= (int64_t{1} << 31) &&
                (c.pipeline_comm == "cached" || c.pipeline_comm == "naive"),
            "training config: 'parallel' records ranks " + std::to_string(c.ranks) + ", pipeline " +
                std::to_string(c.pipeline) + ", virtual_stages " +
                std::to_string(c.virtual_stages) + ", pipeline_comm '" + c.pipeline_comm +
                "', which no run trains with (ranks, pipeline and virtual_stages >= 1; "
                "pipeline_comm cached or naive)");
    }
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("training config JSON is invalid: ") + e.what());
  }
  return c;
}

namespace {
std::string fingerprint_of(const std::string& json_text, bool with_data_dir) {
  nlohmann::json j = parse_json(json_text);
  j.erase("out_dir");
  j.erase("runtime");                       // (where it trains: a resume may change it)
  j.erase("parallel");                      // (on how many ranks: likewise)
  j.erase("sample");                        // (the closing sample is not the run's)
  if (!with_data_dir) j.erase("data_dir");  // (where a comparison keeps its data: it may move)
  return hex64(fnv1a64(j.dump()));
}
}  // namespace

std::string train_config_fingerprint(const std::string& json_text) {
  return fingerprint_of(json_text, false);
}

bool train_config_fingerprint_matches(const std::string& recorded, const std::string& json_text) {
  // (checkpoints of builds before 2026-12-03 fingerprinted data_dir too)
  return recorded == fingerprint_of(json_text, false) ||
         recorded == fingerprint_of(json_text, true);
}

}  // namespace attnres
