// `attnres generate`: stream text from a checkpoint with KV-cache decoding.
#include <cstdio>
#include <filesystem>

#include "attnres/checkpoint.hpp"
#include "attnres/error.hpp"
#include "attnres/generate.hpp"
#include "attnres/tokenizer.hpp"
#include "backend/backend.hpp"
#include "cli/commands.hpp"
#include "cli/device_options.hpp"
#include "cli/option_checks.hpp"

namespace attnres::cli {

namespace {

struct GenArgs {
  std::string model, prompt;
  DeviceArgs dev;
  int64_t max_new = 200;
  SamplingConfig sc;
};

void run_generate(const GenArgs& a) {
  a.sc.validate();
  std::shared_ptr<Backend> be = open_backend(a.dev);
  Metadata meta;
  auto model = load_model(a.model, &meta, 0, be);
  auto tok = load_checkpoint_tokenizer(meta, a.model, model->config().vocab_size);
  const int64_t vocab = model->config().vocab_size;  // (28th pass: taken and doing nothing)
  check(a.sc.top_k < vocab, "--top-k " + std::to_string(a.sc.top_k) +
                                " keeps every token of the model's " + std::to_string(vocab) +
                                "-token vocabulary, so it cuts nothing: drop it, or give fewer "
                                "than " +
                                std::to_string(vocab));
  // Exactly the prompt's tokens: no BOS or other token is added.
  const std::vector<int32_t> prompt = tok->encode(a.prompt);
  // The prompt is echoed once generate has accepted it (a prompt longer than the context was
  // printed whole, then refused: sixteenth hostile pass).
  bool echoed = false;
  auto echo = [&] {
    if (echoed) return;
    echoed = true;
    std::fputs(a.prompt.c_str(), stdout);
    std::fflush(stdout);
  };
  // Stream: decode everything generated so far and print what is new (so multi-token characters
  // and pieces come out whole).
  std::vector<int32_t> gen;
  std::string printed;
  generate(*model, prompt, a.max_new, a.sc, [&](int32_t t) {
    echo();
    gen.push_back(t);
    const std::string text = tok->decode(gen);
    if (text.size() > printed.size() && text.compare(0, printed.size(), printed) == 0) {
      std::fwrite(text.data() + printed.size(), 1, text.size() - printed.size(), stdout);
      std::fflush(stdout);
      printed = text;
    }
    return true;
  });
  echo();
  std::fputs("\n", stdout);
  std::fflush(stdout);
  if (static_cast<int64_t>(gen.size()) < a.max_new) {  // (the context filled up first)
    std::fprintf(stderr,
                 "note: generated %zu of the %lld tokens asked for: the model's context of %lld "
                 "tokens is full (the prompt has %zu)\n",
                 gen.size(), static_cast<long long>(a.max_new),
                 static_cast<long long>(model->config().max_seq_len), prompt.size());
  }
}

}  // namespace

void add_generate(CLI::App& app) {
  auto a = std::make_shared<GenArgs>();
  CLI::App* s =
      app.add_subcommand("generate", "Generate text from a checkpoint (KV-cache decoding)");
  s->add_option("model,--model", a->model, "model.safetensors")->required();
  s->add_option("--prompt", a->prompt, "Text to continue (its tokens exactly; no BOS added)")
      ->required();
  s->add_option("--max-new-tokens,-n", a->max_new, "Tokens to generate")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  s->add_option("--temperature", a->sc.temperature, "0 = greedy (deterministic)")
      ->capture_default_str();
  s->add_option("--top-k", a->sc.top_k, "Sample from the k most likely tokens (0 = off)")
      ->capture_default_str();
  s->add_option("--top-p", a->sc.top_p, "Nucleus sampling mass (1 = off)")->capture_default_str();
  s->add_option("--seed", a->sc.seed, "Sampling seed")
      ->check(uint64_value())
      ->capture_default_str();
  add_device_options(s, a->dev);
  s->callback([a, s] {
    // Greedy decoding samples nothing: the sampling options would be taken and do nothing.
    if (a->sc.temperature == 0) {
      for (const char* o : {"--top-k", "--top-p", "--seed"}) {
        check(s->count(o) == 0, std::string(o) +
                                    " shapes sampling, but --temperature 0 decodes greedily "
                                    "(the most likely token, no randomness): drop it, or give "
                                    "a --temperature above 0");
      }
    }
    run_generate(*a);
  });
}

}  // namespace attnres::cli
