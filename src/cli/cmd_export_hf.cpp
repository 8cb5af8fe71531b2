// `attnres export-hf CKPT --out HF_DIR`: an attnres checkpoint as a Hugging Face directory, with
// its SentencePiece tokenizer: a PreNorm model as LlamaForCausalLM, a Full/Block AttnRes model in
// Kimi K3's tensor layout with its modeling_attnres.py (trust_remote_code).
#include <cstdio>
#include <filesystem>

#include "attnres/checkpoint.hpp"
#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/interop.hpp"
#include "cli/commands.hpp"

namespace fs = std::filesystem;

namespace attnres::cli {

namespace {

struct ExportArgs {
  std::string model, out;
  bool overwrite = false;
};

void run_export(const ExportArgs& a) {
  Metadata meta;
  auto model = load_model(a.model, &meta);
  auto tok = load_checkpoint_tokenizer(meta, a.model, model->config().vocab_size);
  const std::string tok_file =
      tok->model_data().empty() ? "" : checkpoint_tokenizer_file(meta, a.model);
  {  // (--overwrite must never replace the directory the checkpoint is read from)
    std::error_code ec;
    const fs::path in = fs::weakly_canonical(a.model, ec), out = fs::weakly_canonical(a.out, ec);
    const std::string rel = fs::relative(in, out, ec).string();
    check(ec || rel.empty() || rel.rfind("..", 0) == 0,
          "--out '" + a.out + "' holds the checkpoint being exported ('" + a.model +
              "'); write the export elsewhere");
  }
  // (what the weights trained on, so that eval of the re-imported model still knows; 24th pass)
  export_hf(*model, tok_file, a.out, a.overwrite, training_record(meta));
  const bool attnres = model->config().residual.is_attnres();
  std::printf("wrote %s: %s, %lld parameters (float32), %s\n", a.out.c_str(),
              attnres ? "AttnResForCausalLM (Kimi K3 tensor names, modeling_attnres.py)"
                      : "LlamaForCausalLM",
              static_cast<long long>(model->num_params()),
              tok_file.empty() ? "no tokenizer file (the byte tokenizer: token id = byte value)"
                               : "tokenizer.model (SentencePiece)");
  std::printf("  load it with: transformers.AutoModelForCausalLM.from_pretrained(\"%s\"%s)\n",
              a.out.c_str(), attnres ? ", trust_remote_code=True" : "");
}

}  // namespace

void add_export_hf(CLI::App& app) {
  auto a = std::make_shared<ExportArgs>();
  CLI::App* s = app.add_subcommand(
      "export-hf",
      "Write a checkpoint as a Hugging Face directory (config.json, model.safetensors, "
      "tokenizer): PreNorm as LlamaForCausalLM, Full/Block AttnRes with Kimi K3's tensor names "
      "and a modeling_attnres.py (trust_remote_code=True)");
  s->add_option("model,--model", a->model, "model.safetensors")->required();
  s->add_option("--out", a->out, "The Hugging Face directory to write")->required();
  s->add_flag("--overwrite", a->overwrite, "Replace --out if it exists");
  s->callback([a] { run_export(*a); });
}

}  // namespace attnres::cli
