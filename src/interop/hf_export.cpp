// `attnres export-hf`: an attnres PreNorm model as a Hugging Face LlamaForCausalLM directory.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/interop.hpp"
#include "attnres/safetensors.hpp"
#include "interop/modeling_attnres.hpp"

namespace fs = std::filesystem;

namespace attnres {

namespace {

constexpr const char* kExportMark = "written_by_attnres";

// Whether `path` is the model.safetensors of an earlier export-hf (it carries kExportMark).
bool written_by_export(const fs::path& path) {
  try {
    const SafetensorsReader r = SafetensorsReader::open(path.string());
    return r.metadata().count(kExportMark) > 0;
  } catch (const Error&) {
    return false;
  }
}

// config.json of the model `c` describes (transformers 4 and 5 read top-level rope_theta): a
// LlamaForCausalLM for PreNorm; for Full/Block AttnRes our modeling_attnres.py's model, with the
// depth mix's keys (attn_res_block_size is Kimi K3's name, in layers, where S is even).
std::string hf_config(const ModelConfig& c, bool byte_tokenizer) {
  const bool attnres = c.residual.is_attnres();
  nlohmann::json j = {
      {"architectures", {attnres ? "AttnResForCausalLM" : "LlamaForCausalLM"}},
      {"model_type", attnres ? "attnres" : "llama"},
      {"hidden_size", c.d_model},
      {"intermediate_size", c.ffn_hidden},
      {"num_hidden_layers", c.n_layer},
      {"num_attention_heads", c.n_head},
      {"num_key_value_heads", c.n_kv_head},
      {"head_dim", c.head_dim()},
      {"hidden_act", "silu"},
      {"max_position_embeddings", c.max_seq_len},
      {"rms_norm_eps", c.norm_eps},
      {"rope_theta", c.rope_theta},
      {"rope_scaling", nullptr},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"tie_word_embeddings", c.tied},
      {"vocab_size", c.vocab_size},
      {"torch_dtype", "float32"},
      {"bos_token_id", nullptr},
      {"eos_token_id", nullptr},
  };
  // No tokenizer file: token id = byte value, recorded so that import-hf can read it back.
  if (byte_tokenizer) j["attnres_tokenizer"] = "byte";
  if (attnres) {
    const int64_t S = c.residual.effective_block_size();
    j["auto_map"] = {{"AutoConfig", "modeling_attnres.AttnResConfig"},
                     {"AutoModelForCausalLM", "modeling_attnres.AttnResForCausalLM"}};
    j["attnres_residual"] = to_string(c.residual.mode);
    j["attnres_block_size"] = S;
    j["attnres_key_norm_eps"] = c.key_norm_eps();
    if (c.residual.mode == ResidualMode::block && S % 2 == 0) j["attn_res_block_size"] = S / 2;
  }
  return j.dump(2) + "\n";
}

// What modeling_attnres.py computes: softmax over sources, RMS key norm, one static query per
// mixer, every source. Other variants (the ablations) have no Hugging Face form yet.
void check_exportable(const ModelConfig& c) {
  const ResidualConfig& r = c.residual;
  check(r.mode == ResidualMode::prenorm || r.is_attnres(),
        std::string("export-hf writes PreNorm, Full and Block AttnRes models; a '") +
            to_string(r.mode) + "' model has no Hugging Face form");
  if (!r.is_attnres()) return;
  auto refuse = [](const std::string& what) {
    throw Error("export-hf: this model's depth mix has " + what +
                ", which the exported modeling_attnres.py does not compute (it computes the "
                "paper's AttnRes: softmax, RMS key norm, static queries, one head, every source, "
                "temperature 1)");
  };
  if (r.gate != DepthGate::softmax) refuse("a sigmoid gate");
  if (r.key_norm != KeyNorm::rms) refuse("no key norm");
  if (r.query != DepthQuery::static_query) refuse("dynamic queries");
  if (r.heads != 1) refuse(std::to_string(r.heads) + " heads");
  if (r.window != 0) refuse("a window of " + std::to_string(r.window) + " sources");
  if (r.temperature != 1) refuse("temperature " + std::to_string(r.temperature));
}

void write_weights(const Model& model, const std::string& path,
                   const std::map<std::string, std::string>& metadata) {
  std::vector<float> host;
  const float* p = model.params_on_host(host);
  SafetensorsWriter w;
  for (const auto& [k, v] : metadata) w.set_metadata(k, v);
  w.set_metadata("format", "pt");            // (transformers refuses a file without it)
  w.set_metadata(kExportMark, "export-hf");  // (what --overwrite may replace)
  for (const ParamEntry& e : model.layout().entries()) {
    const std::string hn = hf_tensor_name(e.name);
    check(!hn.empty(), "internal: tensor '" + e.name + "' has no Hugging Face name");
    w.add_f32(hn, hf_tensor_shape(e.name, e.shape), p + e.offset);
  }
  w.write(path);
}

}  // namespace

void export_hf(const Model& model, const std::string& tokenizer_model, const std::string& out_dir,
               bool overwrite, const std::map<std::string, std::string>& weights_metadata) {
  const ModelConfig& c = model.config();
  check_exportable(c);
  std::error_code ec;
  const bool exists = fs::exists(fs::symlink_status(out_dir, ec));
  check(!exists || overwrite,
        "--out '" + out_dir + "' exists; pass --overwrite to replace it, or choose another path");
  check(!exists || fs::is_directory(fs::symlink_status(out_dir, ec)),
        "--out '" + out_dir + "' exists and is not a directory; choose another path");
  if (exists) {  // --overwrite replaces an earlier export, never a run or the user's files
    const fs::path weights = fs::path(out_dir) / "model.safetensors";
    check(fs::is_empty(out_dir, ec) ||
              (fs::is_regular_file(fs::symlink_status(weights, ec)) && written_by_export(weights)),
          "--out '" + out_dir +
              "' is not an earlier export of attnres (its model.safetensors is missing or was "
              "written by another tool, e.g. a Hugging Face model's): --overwrite replaces only "
              "attnres' own exports; choose another --out");
    for (const auto& e : fs::directory_iterator(out_dir, ec)) {
      const std::string n = e.path().filename().string();
      // (exactly the files an export writes: anything else there is someone's, e.g. a
      // generation_config.json written by hand, and would be lost with the old export)
      const bool exported = n == "config.json" || n == "model.safetensors" ||
                            n == "tokenizer.model" || n == "tokenizer_config.json" ||
                            n == "modeling_attnres.py";
      check(exported && fs::is_regular_file(fs::symlink_status(e.path(), ec)),
            "--out '" + out_dir + "' holds '" + n +
                "', which export-hf does not write: --overwrite replaces only an earlier export "
                "(config.json, model.safetensors, tokenizer files); choose another --out");
    }
  }
  const fs::path out = fs::absolute(out_dir);
  fs::create_directories(out.parent_path(), ec);
  check(!ec, "cannot create the directory of --out '" + out_dir + "': " + ec.message());
  // Both names are fresh directories made by mkdtemp: a path someone placed there (a link, a
  // directory of theirs) is never written into or removed.
  const fs::path tmp = make_temp_dir(out.string() + ".tmp.", "next to --out");
  const mode_t mask = ::umask(0);  // (mkdtemp's 0700 would hide the export from other users)
  ::umask(mask);
  (void)::chmod(tmp.c_str(), 0777 & ~mask);
  try {
    write_file_atomic((tmp / "config.json").string(), hf_config(c, tokenizer_model.empty()));
    write_weights(model, (tmp / "model.safetensors").string(), weights_metadata);
    if (c.residual.is_attnres()) {
      write_file_atomic((tmp / "modeling_attnres.py").string(), kModelingAttnRes);
    }
    if (!tokenizer_model.empty()) {
      write_file_atomic((tmp / "tokenizer.model").string(), read_file(tokenizer_model));
      const nlohmann::json tc = {{"tokenizer_class", "LlamaTokenizer"},
                                 {"add_bos_token", false},
                                 {"add_eos_token", false}};
      write_file_atomic((tmp / "tokenizer_config.json").string(), tc.dump(2) + "\n");
    }
    // One atomic swap where the file system offers it: a kill at any moment leaves the old
    // export or the new one at --out (two renames left nothing there in between). tmp then
    // holds the old export.
    if (exists && ::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, out.c_str(), RENAME_EXCHANGE) == 0) {
      fs::remove_all(tmp, ec);
    } else if (exists) {
      const fs::path old = make_temp_dir(out.string() + ".old.", "next to --out");
      fs::rename(out, old);  // replaces the empty directory mkdtemp made
      if (::rename(tmp.c_str(), out.c_str()) != 0) {
        const int err = errno;
        fs::rename(old, out, ec);  // the earlier export goes back where it was
        throw Error("cannot move the export into place: " + errno_text(err));
      }
      fs::remove_all(old, ec);
    } else {
      fs::rename(tmp, out);
    }
  } catch (const std::exception& e) {
    fs::remove_all(tmp, ec);
    throw Error("export to '" + out_dir + "' failed: " + cause_of(e) +
                "; nothing was written there");
  }
}

}  // namespace attnres
