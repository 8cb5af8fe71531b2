// `attnres import-hf`: a Hugging Face Llama-family directory as an attnres model (interop.hpp).
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/interop.hpp"
#include "attnres/safetensors.hpp"
#include "attnres/tokenizer.hpp"
#include "core/json_field.hpp"
#include "interop/hf_internal.hpp"

namespace attnres {

namespace {

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// A shard name from model.safetensors.index.json: a plain file name in the model directory.
bool plain_file_name(const std::string& s) {
  return !s.empty() && s != "." && s != ".." && s.find('/') == std::string::npos &&
         s.find('\0') == std::string::npos;
}

// The weight files of `dir`, in order: model.safetensors, or the index's shards (then `listed`
// receives the index's tensor -> shard path map).
std::vector<std::string> weight_files(const std::string& dir,
                                      std::map<std::string, std::string>* listed) {
  const std::string index = join_path(dir, "model.safetensors.index.json");
  const std::string single = join_path(dir, "model.safetensors");
  if (exists(single)) return {single};  // (transformers, too, prefers it to an index)
  if (!exists(index)) {
    const bool bin = exists(join_path(dir, "pytorch_model.bin")) ||
                     exists(join_path(dir, "pytorch_model.bin.index.json"));
    throw Error("'" + dir + "' has no model.safetensors (nor model.safetensors.index.json)" +
                (bin ? std::string("; it has PyTorch .bin weights, which attnres does not read "
                                   "(pickle): re-save them as safetensors with transformers, "
                                   "model.save_pretrained(dir, safe_serialization=True)")
                     : std::string("; give a Hugging Face model directory")));
  }
  nlohmann::json j;
  try {
    j = parse_json(read_file(index));
  } catch (const nlohmann::json::exception& e) {
    throw Error("'" + index + "' is not valid JSON (" + e.what() + ")");
  }
  auto wm = j.find("weight_map");
  check(j.is_object() && wm != j.end() && wm->is_object() && !wm->empty(),
        "'" + index + "' has no 'weight_map' object naming the shards");
  std::set<std::string> names;
  for (const auto& [tensor, file] : wm->items()) {
    check(file.is_string() && plain_file_name(file.get<std::string>()),
          "'" + index + "': the shard of '" + tensor + "' is " + file.dump() +
              ", not a file name in the model directory");
    names.insert(file.get<std::string>());
    (*listed)[tensor] = join_path(dir, file.get<std::string>());
  }
  std::vector<std::string> out;
  for (const std::string& n : names) {
    const std::string p = join_path(dir, n);
    check(exists(p), "shard '" + p + "' named by '" + index +
                         "' is missing; download the whole model directory again");
    out.push_back(p);
  }
  return out;
}

// The tensors every shard holds: name -> index into `readers`. A tensor in two shards is an error.
std::map<std::string, size_t> tensor_index(const std::vector<SafetensorsReader>& readers) {
  std::map<std::string, size_t> where;
  for (size_t i = 0; i < readers.size(); i++) {
    for (const std::string& n : readers[i].names()) {
      auto [it, fresh] = where.emplace(n, i);
      check(fresh, "tensor '" + n + "' is in both '" + readers[it->second].path() + "' and '" +
                       readers[i].path() + "'; the model directory is inconsistent");
    }
  }
  return where;
}

// A tensor the import does not map: RoPE's inverse frequencies (recomputed) are skipped; a bias
// or anything else means the model is not plain Llama.
void check_unmapped(const std::string& name, const std::string& file, bool tied) {
  auto ends = [&](const char* s) {
    const std::string t = s;
    return name.size() >= t.size() && name.compare(name.size() - t.size(), t.size(), t) == 0;
  };
  if (ends("rotary_emb.inv_freq")) return;
  if (tied && name == "lm_head.weight") return;  // a tied head saved anyway: the embedding wins
  check(!ends(".bias"), "'" + file + "' has tensor '" + name +
                            "': biases are not supported; attnres imports plain Llama-family "
                            "models only (docs/INTEROP.md)");
  throw Error("'" + file + "' has tensor '" + name +
              "', which a Llama model does not have; it is another architecture "
              "(docs/INTEROP.md lists the tensors attnres reads)");
}

struct Opened {
  HfSource src;
  std::vector<SafetensorsReader> readers;
  std::map<std::string, size_t> where;
};

Opened open_source(const std::string& dir, int64_t max_seq_len) {
  Opened o;
  HfSource& s = o.src;
  s.dir = dir;
  s.config = hf::parse_config(join_path(dir, "config.json"));
  if (max_seq_len > 0) s.config.max_seq_len = max_seq_len;
  s.config.validate();
  std::map<std::string, std::string> listed;
  s.shards = weight_files(dir, &listed);
  for (const std::string& p : s.shards) o.readers.push_back(SafetensorsReader::open(p));
  for (const SafetensorsReader& r : o.readers)
    s.weights_metadata.insert(r.metadata().begin(), r.metadata().end());
  o.where = tensor_index(o.readers);
  for (const auto& [tensor, shard] : listed) {  // the index must tell the truth
    auto it = o.where.find(tensor);
    check(it != o.where.end() && o.readers[it->second].path() == shard,
          "'" + join_path(dir, "model.safetensors.index.json") + "' puts tensor '" + tensor +
              "' in '" + shard +
              "', which does not hold it; the model directory is "
              "inconsistent (download it again)");
  }
  // Every tensor the config implies, with its shape; then nothing else.
  std::set<std::string> dtypes, mapped;
  const ParamLayout layout = Model::layout_for(s.config);
  for (const ParamEntry& e : layout.entries()) {
    const std::string hn = hf_tensor_name(e.name);
    auto it = o.where.find(hn);
    check(it != o.where.end(),
          "'" + dir + "' has no tensor '" + hn + "' (attnres '" + e.name +
              "'), which its config.json implies" +
              (hn == "lm_head.weight" ? std::string(" (tie_word_embeddings is false)")
                                      : std::string()));
    const TensorInfo& t = o.readers[it->second].info(hn);
    const std::vector<int64_t> want = hf_tensor_shape(e.name, e.shape);
    check(t.shape == want, "tensor '" + hn + "' in '" + o.readers[it->second].path() +
                               "' has shape " + shape_str(t.shape) + " but config.json needs " +
                               shape_str(want) + "; the weights and the config disagree");
    check(t.dtype == DType::F32 || t.dtype == DType::BF16 || t.dtype == DType::F16,
          "tensor '" + hn + "' in '" + o.readers[it->second].path() + "' is " +
              dtype_name(t.dtype) + "; attnres reads F32, BF16 and F16 weights");
    dtypes.insert(dtype_name(t.dtype));
    mapped.insert(hn);
  }
  for (const auto& [n, i] : o.where) {
    if (!mapped.count(n)) check_unmapped(n, o.readers[i].path(), s.config.tied);
  }
  s.unread_tied_head = s.config.tied && o.where.count("lm_head.weight") > 0;
  s.weights_dtype = dtypes.size() == 1 ? *dtypes.begin() : "mixed";
  return o;
}

// Whether config.json says the model reads bytes (export-hf of a byte-tokenizer model).
bool byte_tokenizer(const std::string& dir) {
  const nlohmann::json j = parse_json(read_file(join_path(dir, "config.json")));  // (checked)
  auto t = j.find("attnres_tokenizer");
  return t != j.end() && t->is_string() && t->get<std::string>() == "byte";
}

void attach_tokenizer(HfSource& s) {
  const std::string sp = join_path(s.dir, "tokenizer.model");
  if (!exists(sp) && byte_tokenizer(s.dir)) {
    s.tokenizer_pieces = 256;
    check(s.config.vocab_size == 256, "'" + join_path(s.dir, "config.json") +
                                          "' names the byte tokenizer (256 ids) but its "
                                          "vocab_size is " +
                                          std::to_string(s.config.vocab_size) +
                                          "; the directory is inconsistent");
    return;
  }
  if (!exists(sp)) {
    const bool json = exists(join_path(s.dir, "tokenizer.json"));
    throw Error("'" + s.dir + "' has no SentencePiece tokenizer.model" +
                (json ? std::string("; its tokenizer.json (a byte-level BPE, as Llama 3 and "
                                    "GPT-2 use) is not supported: attnres reads SentencePiece "
                                    "tokenizers (Llama 1 and 2, Mistral, TinyLlama)")
                      : std::string("; copy the model's tokenizer.model into it")));
  }
  auto tok = load_sentencepiece(sp);
  s.tokenizer_model = sp;
  s.tokenizer_pieces = tok->vocab_size();
  check(s.tokenizer_pieces == s.config.vocab_size,
        "tokenizer '" + sp + "' has " + std::to_string(s.tokenizer_pieces) +
            " pieces but config.json's vocab_size is " + std::to_string(s.config.vocab_size) +
            "; attnres needs them equal (a padded vocabulary is not supported yet)");
}

// Copies every tensor the source has into `model` (widened to float32): all of them for a model
// of the source's own mode (checked by open_source); the core for an upcycled one, whose mode's
// own tensors keep the model's initialisation.
void load_weights(Model& model, const Opened& o) {
  std::vector<float> host;
  float* p = model.params_stage(host);
  for (const ParamEntry& e : model.layout().entries()) {
    const std::string hn = hf_tensor_name(e.name);
    auto at = o.where.find(hn);
    if (hn.empty() || at == o.where.end()) continue;
    const SafetensorsReader& r = o.readers[at->second];
    r.read_f32(hn, hf_tensor_shape(e.name, e.shape), p + e.offset);
    int64_t bad = 0;
    for (int64_t i = 0; i < e.numel; i++) bad += !std::isfinite(p[e.offset + i]);
    check(bad == 0, "tensor '" + hn + "' in '" + r.path() + "' holds " + std::to_string(bad) +
                        " non-finite values (NaN or Inf); the model is unusable");
  }
  model.commit_params(host);
}

std::unique_ptr<Model> build(const Opened& o, const ResidualConfig& residual) {
  ModelConfig c = o.src.config;
  c.residual = residual;
  auto m = std::make_unique<Model>(c);
  m->init_weights(0);  // the mode's own tensors as a new run starts them (SPEC 2)
  load_weights(*m, o);
  return m;
}

// Logits (T,V) of `m` on the probe tokens.
std::vector<float> probe_logits(Model& m, const std::vector<int32_t>& tokens) {
  m.forward(tokens.data(), nullptr, 1, static_cast<int64_t>(tokens.size()));
  const float* l = m.logits();
  return std::vector<float>(l, l + tokens.size() * m.config().vocab_size);
}

}  // namespace

HfSource inspect_hf(const std::string& dir, int64_t max_seq_len) {
  Opened o = open_source(dir, max_seq_len);
  attach_tokenizer(o.src);
  return o.src;
}

HfImport import_hf(const std::string& dir, const HfImportOptions& opt) {
  check(opt.residual.mode == ResidualMode::prenorm || opt.residual.is_attnres(),
        "import-hf: --residual must be prenorm, full or block");
  Opened o = open_source(dir, opt.max_seq_len);
  attach_tokenizer(o.src);
  HfImport out;
  out.source = o.src;
  const ResidualConfig& own = o.src.config.residual;
  if (own.is_attnres()) {  // an AttnRes export: imported as it is
    // (an explicit --residual prenorm wrote the full model without a word; 23rd hostile pass)
    check((opt.residual.mode == ResidualMode::prenorm && !opt.residual_given) ||
              (opt.residual.mode == own.mode &&
               opt.residual.effective_block_size() == own.effective_block_size()),
          "'" + dir + "' holds a " + to_string(own.mode) + " AttnRes model" +
              (own.mode == ResidualMode::block
                   ? " (blocks of " + std::to_string(own.block_size) + " sublayers)"
                   : std::string()) +
              "; it is imported as it is: drop --residual and --block-size");
    out.model = build(o, own);
    return out;
  }
  if (opt.residual.mode == ResidualMode::prenorm) {
    out.model = build(o, opt.residual);
    return out;
  }
  // The probe: fixed tokens through the PreNorm import, then through the AttnRes one (one model
  // in memory at a time).
  const int64_t V = o.src.config.vocab_size;
  std::vector<int32_t> tokens(static_cast<size_t>(std::min<int64_t>(32, o.src.config.max_seq_len)));
  for (size_t i = 0; i < tokens.size(); i++) {
    tokens[i] = static_cast<int32_t>((static_cast<int64_t>(i) * 7919 + 13) % V);
  }
  std::vector<float> ref = probe_logits(*build(o, ResidualConfig{}), tokens);
  out.model = build(o, opt.residual);
  std::vector<float> got = probe_logits(*out.model, tokens);
  out.probe_max_diff = 0;
  out.probe_max_logit = 0;
  for (size_t i = 0; i < ref.size(); i++) {
    out.probe_max_diff = std::max(out.probe_max_diff, std::fabs(double(got[i]) - ref[i]));
    out.probe_max_logit = std::max(out.probe_max_logit, std::fabs(double(ref[i])));
  }
  out.probe_tokens = static_cast<int64_t>(tokens.size());
  return out;
}

}  // namespace attnres
