// `attnres export-hf`: an attnres PreNorm model as a Hugging Face LlamaForCausalLM directory.
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/interop.hpp"
#include "attnres/safetensors.hpp"

namespace fs = std::filesystem;

namespace attnres {

namespace {

// config.json of the Llama model `c` describes (transformers 4 and 5 read top-level rope_theta).
std::string llama_config(const ModelConfig& c) {
  nlohmann::json j = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
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
  return j.dump(2) + "\n";
}

void write_weights(const Model& model, const std::string& path) {
  std::vector<float> host;
  const float* p = model.params_on_host(host);
  SafetensorsWriter w;
  w.set_metadata("format", "pt");  // (transformers refuses a file without it)
  const auto& entries = model.layout().entries();
  for (size_t k = 0; k < model.core_entries(); k++) {
    const ParamEntry& e = entries[k];
    w.add_f32(hf_tensor_name(e.name), e.shape, p + e.offset);
  }
  w.write(path);
}

}  // namespace

void export_hf(const Model& model, const std::string& tokenizer_model, const std::string& out_dir,
               bool overwrite) {
  const ModelConfig& c = model.config();
  check(c.residual.mode == ResidualMode::prenorm,
        std::string("export-hf writes PreNorm models as LlamaForCausalLM; exporting a '") +
            to_string(c.residual.mode) +
            "' model (its depth-mix tensors and modeling code) is not supported yet");
  std::error_code ec;
  const bool exists = fs::exists(fs::symlink_status(out_dir, ec));
  check(!exists || overwrite,
        "--out '" + out_dir + "' exists; pass --overwrite to replace it, or choose another path");
  check(!exists || fs::is_directory(fs::symlink_status(out_dir, ec)),
        "--out '" + out_dir + "' exists and is not a directory; choose another path");
  if (exists) {  // --overwrite replaces an earlier export, never a run or the user's files
    for (const auto& e : fs::directory_iterator(out_dir, ec)) {
      const std::string n = e.path().filename().string();
      const bool exported = n == "config.json" || n == "model.safetensors" ||
                            n == "tokenizer.model" || n == "tokenizer_config.json" ||
                            n == "generation_config.json";
      check(exported && fs::is_regular_file(fs::symlink_status(e.path(), ec)),
            "--out '" + out_dir + "' holds '" + n +
                "', which export-hf does not write: --overwrite replaces only an earlier export "
                "(config.json, model.safetensors, tokenizer files); choose another --out");
    }
  }
  const fs::path out = fs::absolute(out_dir);
  fs::create_directories(out.parent_path(), ec);
  check(!ec, "cannot create the directory of --out '" + out_dir + "': " + ec.message());
  const fs::path tmp = out.string() + ".tmp." + std::to_string(::getpid());
  fs::remove_all(tmp, ec);
  try {
    fs::create_directory(tmp);
    write_file_atomic((tmp / "config.json").string(), llama_config(c));
    write_weights(model, (tmp / "model.safetensors").string());
    if (!tokenizer_model.empty()) {
      write_file_atomic((tmp / "tokenizer.model").string(), read_file(tokenizer_model));
      const nlohmann::json tc = {{"tokenizer_class", "LlamaTokenizer"},
                                 {"add_bos_token", false},
                                 {"add_eos_token", false}};
      write_file_atomic((tmp / "tokenizer_config.json").string(), tc.dump(2) + "\n");
    }
    if (exists) {
      const fs::path old = out.string() + ".old." + std::to_string(::getpid());
      fs::rename(out, old);
      fs::rename(tmp, out);
      fs::remove_all(old, ec);
    } else {
      fs::rename(tmp, out);
    }
  } catch (const std::exception& e) {
    fs::remove_all(tmp, ec);
    throw Error("export to '" + out_dir + "' failed: " + e.what() + "; nothing was written there");
  }
}

}  // namespace attnres
