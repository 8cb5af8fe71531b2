#include "cli/inert_options.hpp"

#include "attnres/config.hpp"

namespace attnres::cli {

namespace {

void add_if_given(std::vector<InertOption>& out, const CLI::App& s, const char* option,
                  const std::string& why) {
  const CLI::Option* o = s.get_option_no_throw(option);  // (compare has no --prompt)
  if (o != nullptr && o->count() > 0) out.push_back({option, std::string(option) + " " + why});
}

// The residual's options: blocks, depth attention, and the router's own learning rate.
void residual_options(std::vector<InertOption>& out, const CLI::App& s, const TrainConfig& c) {
  const ResidualMode mode = c.model.residual.mode;
  const std::string residual = std::string("the residual is '") + to_string(mode) + "'";
  if (mode != ResidualMode::block) {
    for (const char* o : {"--block-size", "--block-layers"}) {
      add_if_given(out, s, o,
                   "sizes the blocks of --residual block, but " + residual +
                       ", which has no blocks: drop it, or train with --residual block");
    }
  }
  if (mode != ResidualMode::full && mode != ResidualMode::block) {
    for (const char* o : {"--attnres-gate", "--attnres-key-norm", "--attnres-heads",
                          "--attnres-query", "--attnres-window", "--attnres-key-eps",
                          "--attnres-temperature", "--attnres-two-phase"}) {
      add_if_given(out, s, o,
                   "sets the depth attention of --residual full or block, but " + residual +
                       ", which has none: drop it, or train with --residual full or block");
    }
  }
  if ((mode == ResidualMode::full || mode == ResidualMode::block) &&
      c.model.residual.key_norm == KeyNorm::none) {
    add_if_given(out, s, "--attnres-key-eps",
                 "sets the epsilon of the depth keys' RMS norm, but --attnres-key-norm none "
                 "normalises no key: drop it, or pass --attnres-key-norm rms");
  }
  if (mode == ResidualMode::prenorm) {
    for (const char* o : {"--router-lr-mult", "--router-warmup"}) {
      add_if_given(out, s, o,
                   "applies to the residual mode's own tensors, but --residual prenorm has none: "
                   "drop it, or train another --residual");
    }
  }
}

// The tokenizer's and the schedule's options.
void data_and_schedule_options(std::vector<InertOption>& out, const CLI::App& s,
                               const TrainConfig& c) {
  if (c.tokenizer == TokenizerKind::byte) {
    add_if_given(out, s, "--vocab-size",
                 "sets the size of a BPE tokenizer, but the run reads bytes (--tokenizer byte: "
                 "256 ids): drop it, or pass --tokenizer bpe");
  } else if (!c.tokenizer_model.empty()) {
    add_if_given(out, s, "--vocab-size",
                 "sets the size of a BPE tokenizer trained on the corpus, but the run reads text "
                 "with an existing SentencePiece model (--tokenizer-model, or --init-from's "
                 "tokenizer), whose vocabulary is its own: drop --vocab-size");
  }
  if (c.sample_tokens == 0) {
    add_if_given(out, s, "--prompt",
                 "starts the closing sample, but --sample-tokens 0 draws none: drop it, or give "
                 "--sample-tokens above 0");
  }
  const ScheduleKind k = c.schedule.kind;
  if (k != ScheduleKind::wsd) {
    add_if_given(out, s, "--decay-fraction",
                 std::string("sets the decay of --schedule wsd, but the schedule is '") +
                     to_string(k) + "': drop it, or pass --schedule wsd");
  }
  if (k == ScheduleKind::constant) {
    add_if_given(out, s, "--min-lr-ratio",
                 "sets where the learning rate decays to, but --schedule constant keeps it at "
                 "--lr: drop it, or pass --schedule cosine or wsd");
  }
}

// Data parallelism's options that the layout given leaves unused (28th hostile pass).
void parallel_options(std::vector<InertOption>& out, const CLI::App& s, const TrainConfig& c) {
  if (c.pipeline > 1) {
    add_if_given(out, s, "--grad-overlap",
                 "overlaps the data-parallel gradient sum with the backward pass, but --pipeline "
                 "sums the gradients after its schedule: drop it");
  } else if (c.device != Device::cpu) {
    add_if_given(out, s, "--grad-overlap",
                 std::string("overlaps the gradient sum with the backward pass on the CPU, but "
                             "--device ") +
                     to_string(c.device) + " sums the gradients after it: drop it");
  }
}

}  // namespace

std::vector<InertOption> inert_options(const CLI::App& s, const TrainConfig& cfg) {
  std::vector<InertOption> out;
  residual_options(out, s, cfg);
  data_and_schedule_options(out, s, cfg);
  parallel_options(out, s, cfg);
  return out;
}

}  // namespace attnres::cli
