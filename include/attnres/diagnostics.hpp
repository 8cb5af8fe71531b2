// attnres/diagnostics.hpp — what the SPEC 6 analyses look at: per-sublayer output and input
// magnitudes, per-sublayer gradient norms, and the learned depth-attention weights.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attnres/model.hpp"

namespace attnres {

struct Diagnostics {
  std::vector<std::string> sublayers;  // (L) "L0.attn", "L0.mlp", ...
  std::vector<double> input_rms;       // (L) RMS of each sublayer's input x_l
  std::vector<double> output_rms;      // (L) RMS of each sublayer's output
  std::vector<double> grad_norm;       // (L) gradient norm of each sublayer's weights
  bool has_weights = false;            // false for prenorm
  std::vector<std::string> weight_rows, weight_cols;
  std::vector<std::vector<double>> weights;  // mean depth-attention weights (NaN: not a source)
};

// Runs a forward pass over tokens (B,T) and measures magnitudes and depth weights. grad_norm is
// left empty (take it from Model::sublayer_grad_norms() after a backward pass).
Diagnostics measure_diagnostics(Model& model, const int32_t* tokens, int64_t B, int64_t T);

// One JSON object (NaN written as null).
std::string diagnostics_to_json(const Diagnostics& d);

// Fixed-width text table of the depth weights in percent ("" when there are none).
std::string depth_weights_table(const Diagnostics& d);

}  // namespace attnres
