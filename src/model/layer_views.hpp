// Named pointers into the flat parameter buffer for one Transformer block (no string lookups on
// the hot path beyond one per block and pass).
#pragma once

#include <string>

#include "attnres/params.hpp"

namespace attnres {

struct LayerViews {
  const float* attn_norm;  // (d)
  const float* wqkv;       // ((H + 2 Hkv) hd, d): wq, wk, wv stacked
  const float* wo;         // (d, H hd)
  const float* ffn_norm;   // (d)
  const float* w13;        // (2F, d): w1, w3 stacked
  const float* w2;         // (d, F)
};

inline LayerViews layer_views(const ParamLayout& layout, const float* base, int64_t i) {
  const std::string p = "layers." + std::to_string(i) + ".";
  auto at = [&](const char* s) { return base + layout.find(p + s)->offset; };
  return {at("attention_norm.weight"), at("attention.wq.weight"),    at("attention.wo.weight"),
          at("ffn_norm.weight"),       at("feed_forward.w1.weight"), at("feed_forward.w2.weight")};
}

}  // namespace attnres
