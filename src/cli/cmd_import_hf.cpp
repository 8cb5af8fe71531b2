// `attnres import-hf HF_DIR --out model.safetensors`: a Hugging Face Llama-family model as an
// attnres checkpoint (PreNorm, or upcycled to Full / Block AttnRes), with its tokenizer beside it.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include "attnres/checkpoint.hpp"
#include "attnres/data.hpp"
#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/interop.hpp"
#include "cli/commands.hpp"
#include "cli/enum_option.hpp"

namespace fs = std::filesystem;

namespace attnres::cli {

namespace {

struct ImportArgs {
  std::string dir, out;
  HfImportOptions opt;
  int64_t block_layers = 0;
  bool block_size_given = false;  // --block-size on the command line
  bool overwrite = false;
};

bool path_exists(const std::string& p) {
  struct stat st {};
  return ::lstat(p.c_str(), &st) == 0;
}

// The directory --out's file goes into ("." for a bare file name).
std::string dir_of(const std::string& path) {
  const std::string d = std::filesystem::path(path).parent_path().string();
  return d.empty() ? "." : d;
}

// Copies the tokenizer beside --out as tokenizer.model (the checkpoint's reference names it).
// Returns true when it wrote the file (false: the same file was already there). A different
// tokenizer.model there belongs to another checkpoint and is never replaced.
bool place_tokenizer(const std::string& src, const std::string& out) {
  const std::string dst = join_path(dir_of(out), "tokenizer.model");
  const std::string data = read_file(src);
  if (path_exists(dst)) {
    check(read_file(dst) == data,
          "'" + dst +
              "' exists and is another tokenizer (another checkpoint's, beside it); "
              "write --out into another directory");
    return false;
  }
  write_file_atomic(dst, data);
  return true;
}

void print_source(const HfSource& s) {
  const ModelConfig& c = s.config;
  const std::string kind = c.residual.is_attnres()
                               ? std::string("AttnRes (") + to_string(c.residual.mode) +
                                     ", S = " + std::to_string(c.residual.effective_block_size()) +
                                     ")"
                               : std::string("Llama");
  std::printf(
      "read %s: %s, %lld layers, d_model %lld, %lld heads (%lld kv), ffn %lld, "
      "vocab %lld, %s head, rms_norm_eps %g, rope_theta %g, context %lld\n",
      s.dir.c_str(), kind.c_str(), static_cast<long long>(c.n_layer),
      static_cast<long long>(c.d_model), static_cast<long long>(c.n_head),
      static_cast<long long>(c.n_kv_head), static_cast<long long>(c.ffn_hidden),
      static_cast<long long>(c.vocab_size), c.tied ? "tied" : "untied", c.norm_eps, c.rope_theta,
      static_cast<long long>(c.max_seq_len));
  std::printf("  weights: %zu file(s), %s; tokenizer: %s (%lld pieces)\n", s.shards.size(),
              s.weights_dtype.c_str(),
              s.tokenizer_model.empty() ? "byte" : s.tokenizer_model.c_str(),
              static_cast<long long>(s.tokenizer_pieces));
  if (s.unread_tied_head) {  // (dropped without a word; twenty-first hostile pass)
    std::printf(
        "  note: config.json ties the output head to the embedding (tie_word_embeddings), so "
        "the lm_head.weight in the files is not read, as transformers does\n");
  }
}

void run_import(ImportArgs& a) {
  // (an AttnRes export's own blocks are kept: --block-size alone was dropped without a word)
  check(!a.block_size_given || a.opt.residual.mode == ResidualMode::block,
        "--block-size is an option of --residual block");
  if (a.block_layers > 0) {
    check(a.opt.residual.mode == ResidualMode::block,
          "--block-layers is an option of --residual block");
    a.opt.residual.block_size = 2 * a.block_layers;
  }
  check(!a.out.empty() && a.out.back() != '/',
        "--out '" + a.out + "' is not a file path; give the checkpoint's file, e.g. " +
            (a.out.empty() ? std::string("runs/llama/") : a.out) + "model.safetensors");
  check(file_name_of(a.out) != "tokenizer.model",
        "--out '" + a.out +
            "' is where the tokenizer goes (tokenizer.model beside the checkpoint); name the "
            "checkpoint otherwise, e.g. model.safetensors");
  check(a.overwrite || !path_exists(a.out),
        "--out '" + a.out + "' exists; pass --overwrite to replace it, or choose another path");
  {  // A run's model.safetensors, or one of its checkpoints', belongs with the run's other files.
    std::error_code ec;  // (links resolved: a link into a run is that run)
    fs::path d = fs::weakly_canonical(fs::absolute(dir_of(a.out)), ec);
    if (ec) d = fs::absolute(dir_of(a.out)).lexically_normal();
    const bool in_run = path_exists((d / "train_config.json").string()) ||
                        d.parent_path().filename() == "checkpoints";
    check(!in_run, "--out '" + a.out +
                       "' is inside a training run (its train_config.json or checkpoints/ are "
                       "there), whose files belong together; import into another directory");
  }
  check(!path_exists(a.out) || is_attnres_checkpoint(a.out),
        "--out '" + a.out +
            "' exists and is not an attnres checkpoint (another model's weights, a link or "
            "another file); --overwrite replaces only an attnres checkpoint: choose another path");
  HfImport im = import_hf(a.dir, a.opt);
  // Never write over what is being read (--overwrite onto the source's own files).
  std::vector<std::string> sources = im.source.shards;
  const std::string& tok = im.source.tokenizer_model;  // ("" = the byte tokenizer)
  if (!tok.empty()) sources.push_back(tok);
  for (const std::string& src : sources) {
    std::error_code ec;
    check(!std::filesystem::equivalent(src, a.out, ec),
          "--out '" + a.out + "' is the Hugging Face model's own file '" + src +
              "'; write the checkpoint elsewhere");
  }
  print_source(im.source);
  std::error_code ec;
  std::filesystem::create_directories(dir_of(a.out), ec);
  check(!ec, "cannot create the directory of --out '" + a.out + "': " + ec.message());
  const bool wrote_tok = !tok.empty() && place_tokenizer(tok, a.out);
  Metadata meta{{"tokenizer", tok.empty() ? "byte" : "sentencepiece:tokenizer.model"},
                {"source", "huggingface:" + absolute_path(a.dir)},
                {kTokenizerHashKey, hex64(fnv1a64(tok.empty() ? "" : read_file(tok)))}};
  // (an attnres export's record of the corpora its weights trained on: eval refuses a val split
  // of them that reaches into training text; the round trip lost it, 24th hostile pass)
  meta.merge(training_record(im.source.weights_metadata));
  try {
    save_model(a.out, *im.model, meta);
  } catch (...) {
    if (wrote_tok) ::unlink(join_path(dir_of(a.out), "tokenizer.model").c_str());
    throw;
  }
  const ModelConfig& c = im.model->config();
  std::printf("wrote %s: %s, %lld parameters", a.out.c_str(), to_string(c.residual.mode),
              static_cast<long long>(im.model->num_params()));
  if (c.residual.mode == ResidualMode::block) {
    std::printf(" (blocks of %lld sublayers", static_cast<long long>(c.residual.block_size));
    if (c.residual.block_size % 2 == 0) {
      std::printf(" = %lld layer%s", static_cast<long long>(c.residual.block_size / 2),
                  c.residual.block_size == 2 ? "" : "s");
    }
    std::printf(")");
  }
  std::printf("; tokenizer %s\n", tok.empty()
                                      ? "byte (token id = byte value)"
                                      : join_path(dir_of(a.out), "tokenizer.model").c_str());
  if (im.probe_tokens > 0) {
    std::printf(
        "  upcycled: zero pseudo-queries, unit key gains. On %lld probe tokens its logits differ "
        "from the PreNorm model's by at most %.3g (largest |logit| %.3g): the function is "
        "PreNorm's up to the RMSNorm epsilon (docs/INTEROP.md)\n",
        static_cast<long long>(im.probe_tokens), im.probe_max_diff, im.probe_max_logit);
  }
}

}  // namespace

void add_import_hf(CLI::App& app) {
  auto a = std::make_shared<ImportArgs>();
  CLI::App* s = app.add_subcommand(
      "import-hf",
      "Convert a Hugging Face Llama-family model directory into an attnres checkpoint "
      "(PreNorm, or upcycled to Full / Block AttnRes with the same function)");
  s->add_option("hf_dir", a->dir,
                "Hugging Face model directory (config.json, model.safetensors or its shards, "
                "tokenizer.model)")
      ->required()
      ->check(CLI::ExistingDirectory);
  s->add_option("--out", a->out, "The attnres checkpoint to write (tokenizer.model goes beside it)")
      ->required();
  ResidualConfig& r = a->opt.residual;
  add_enum_option(s, "--residual", r.mode, parse_residual_mode,
                  "prenorm (the model as it is), full or block (AttnRes, zero queries: the same "
                  "function at step 0)",
                  {"prenorm", "full", "block"});
  auto* mode = s->get_option("--residual");
  auto* bs = s->add_option("--block-size", r.block_size, "block: sublayers per block (S)")
                 ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
                 ->capture_default_str();
  s->add_option("--block-layers", a->block_layers,
                "block: Transformer layers per block (the Kimi K3 convention; S = 2 x this)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 19))
      ->excludes(bs);
  s->add_option("--max-seq-len", a->opt.max_seq_len,
                "Context length of the checkpoint (default: config.json's "
                "max_position_embeddings)")
      ->check(CLI::Range(int64_t{1}, kMaxSeqLen));
  s->add_flag("--overwrite", a->overwrite, "Replace --out if it exists");
  s->callback([a, bs, mode] {
    a->block_size_given = bs->count() > 0;
    a->opt.residual_given = mode->count() > 0;
    run_import(*a);
  });
}

}  // namespace attnres::cli
