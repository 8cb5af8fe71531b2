// `attnres inspect`: the learned depth weights of a checkpoint (mean over a batch of text) and the
// per-sublayer magnitudes, as tables.
#include <cstdio>
#include <filesystem>
#include <optional>

#include "attnres/checkpoint.hpp"
#include "attnres/data.hpp"
#include "attnres/diagnostics.hpp"
#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/train.hpp"
#include "cli/commands.hpp"
#include "cli/train_options.hpp"

namespace attnres::cli {

namespace {

struct InspectArgs {
  std::string model, data, text;
  int64_t tokens = 0;
};

void run_inspect(const InspectArgs& a) {
  Metadata meta;
  auto model = load_model(a.model, &meta);
  auto tok = load_checkpoint_tokenizer(meta, a.model, model->config().vocab_size);
  const int64_t T_max = model->config().max_seq_len;
  const int64_t want = a.tokens > 0 ? std::min(a.tokens, T_max) : T_max;
  std::vector<int32_t> ids;
  std::string source;
  check(a.text.empty() || a.data.empty(),
        "give --text or --data, not both (the model runs on one of them)");
  if (!a.text.empty()) {
    ids = tok->encode(a.text);
    source = "--text";
  } else {
    std::string data = a.data;
    double val_fraction = 0.1;
    std::optional<Corpus> trained;
    if (data.empty()) {
      std::string run_dir;
      if (const auto t = run_config_beside(a.model, meta, &run_dir)) {
        data = t->data_path;
        trained = read_trained_corpus(*t, run_dir);
        val_fraction = t->val_fraction;
      }
    }
    check(!data.empty(), "give --text or --data (no train_config.json beside '" + a.model + "')");
    const Corpus corpus = trained ? std::move(*trained) : read_corpus(data);
    // The start of the held-out split, as in training.
    const int64_t start =
        static_cast<int64_t>(static_cast<double>(corpus.text.size()) * (1.0 - val_fraction));
    ids = tok->encode(std::string_view(corpus.text).substr(start, 64 * want));
    source = data + " (validation split)";
  }
  check(!ids.empty(), "the text encodes to no tokens");
  if (static_cast<int64_t>(ids.size()) > want) {
    if (!a.text.empty()) {  // (cut without a word before: sixteenth hostile pass)
      std::printf("note: --text is %zu tokens; the first %lld are used (%s)\n", ids.size(),
                  static_cast<long long>(want),
                  a.tokens > 0 && a.tokens < T_max ? "--tokens" : "the model's context");
    }
    ids.resize(want);
  }
  const int64_t T = static_cast<int64_t>(ids.size());
  const Diagnostics d = measure_diagnostics(*model, ids.data(), 1, T);
  const ModelConfig& c = model->config();
  std::printf("%s: residual %s", a.model.c_str(), to_string(c.residual.mode));
  if (c.residual.mode == ResidualMode::block)
    std::printf(" (block size %lld)", static_cast<long long>(c.residual.block_size));
  std::printf(", %lld sublayers; %lld tokens of %s\n\n", static_cast<long long>(c.n_sublayers()),
              static_cast<long long>(T), source.c_str());
  if (d.has_weights) {
    std::printf("depth weights (rows: who reads; columns: sources; mean over tokens):\n%s\n",
                depth_weights_table(d).c_str());
  } else {
    std::printf("mode %s has no learned depth weights (every earlier output weighs 1)\n\n",
                to_string(c.residual.mode));
  }
  std::printf("%-9s %12s %12s\n", "sublayer", "input RMS", "output RMS");
  for (size_t l = 0; l < d.sublayers.size(); l++) {
    std::printf("%-9s %12.4g %12.4g\n", d.sublayers[l].c_str(), d.input_rms[l], d.output_rms[l]);
  }
}

}  // namespace

void add_inspect(CLI::App& app) {
  auto a = std::make_shared<InspectArgs>();
  CLI::App* s = app.add_subcommand(
      "inspect", "Print a checkpoint's learned depth-attention weights and sublayer magnitudes");
  s->add_option("model,--model", a->model, "model.safetensors")->required();
  s->add_option("--text", a->text, "Text to run the model on");
  s->add_option("--data", a->data, "Corpus whose validation split to use (default: the run's)");
  s->add_option("--tokens", a->tokens, "Tokens to average over (default 0: the model's context)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  s->callback([a] { run_inspect(*a); });
}

}  // namespace attnres::cli
