// Token sampling (temperature, top-k, nucleus) and the generation loop.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "attnres/error.hpp"
#include "attnres/generate.hpp"
#include "core/rng.hpp"

namespace attnres {

void SamplingConfig::validate() const {
  check(temperature >= 0 && std::isfinite(temperature),
        "--temperature must be a finite number >= 0 (0 = greedy)");
  check(top_k >= 0, "top-k must be >= 0 (0 = off)");
  check(top_p > 0 && top_p <= 1, "top-p must be in (0, 1]");
}

int32_t sample_token(const float* logits, int64_t V, const SamplingConfig& cfg, uint64_t& state) {
  if (cfg.temperature == 0.0) {
    return static_cast<int32_t>(std::max_element(logits, logits + V) - logits);  // first max
  }
  std::vector<int32_t> ids(V);
  std::iota(ids.begin(), ids.end(), 0);
  // Candidates in descending logit order (stable: ties keep the lower id first).
  int64_t keep = V;
  if (cfg.top_k > 0 && cfg.top_k < V) {
    keep = cfg.top_k;
    std::partial_sort(ids.begin(), ids.begin() + keep, ids.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
  } else {
    std::stable_sort(ids.begin(), ids.end(),
                     [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  }
  std::vector<double> p(keep);
  const double mx = logits[ids[0]];
  double sum = 0.0;
  for (int64_t i = 0; i < keep; i++)
    sum += (p[i] = std::exp((logits[ids[i]] - mx) / cfg.temperature));
  if (cfg.top_p < 1.0) {  // smallest prefix whose probability reaches top_p
    double cum = 0.0;
    int64_t cut = keep;
    for (int64_t i = 0; i < keep; i++) {
      cum += p[i] / sum;
      if (cum >= cfg.top_p) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
    sum = std::accumulate(p.begin(), p.begin() + keep, 0.0);
  }
  state = splitmix64(state);
  const double u = static_cast<double>(state >> 11) * 0x1.0p-53 * sum;
  double cum = 0.0;
  for (int64_t i = 0; i < keep; i++) {
    cum += p[i];
    if (u < cum) return ids[i];
  }
  return ids[keep - 1];
}

std::vector<int32_t> generate(const Model& model, const std::vector<int32_t>& prompt,
                              int64_t max_new, const SamplingConfig& cfg,
                              const std::function<bool(int32_t)>& on_token) {
  cfg.validate();
  check(!prompt.empty(), "the prompt encodes to no tokens; give a non-empty --prompt");
  const int64_t ctx = model.config().max_seq_len;
  // (a prompt that fills the context still predicts one token; it was refused with a message
  // that contradicted itself, "32 tokens but the context is 32": 24th hostile pass)
  check(static_cast<int64_t>(prompt.size()) <= ctx,
        "the prompt has " + std::to_string(prompt.size()) +
            " tokens, more than the model's context of " + std::to_string(ctx) +
            "; shorten it to at most " + std::to_string(ctx) + " tokens");
  Decoder dec(model, ctx);
  const int64_t V = model.config().vocab_size;
  const float* logits = dec.feed(prompt.data(), static_cast<int64_t>(prompt.size()));
  logits += (prompt.size() - 1) * V;
  uint64_t state = splitmix64(cfg.seed);
  std::vector<int32_t> out;
  for (int64_t i = 0; i < max_new; i++) {
    // Finite weights can still overflow (e.g. 1e18 in every weight): no token is made up then.
    check(std::all_of(logits, logits + V, [](float x) { return std::isfinite(x); }),
          "the model's next-token scores at position " + std::to_string(dec.position()) +
              " are not finite: its weights overflow the forward pass; the checkpoint is "
              "unusable (use an earlier one)");
    const int32_t tok = sample_token(logits, V, cfg, state);
    out.push_back(tok);
    if (on_token && !on_token(tok)) break;
    if (dec.position() >= ctx) break;  // context full
    logits = dec.feed(&tok, 1);
  }
  return out;
}

}  // namespace attnres
