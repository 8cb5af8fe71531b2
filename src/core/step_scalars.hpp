// The scalars of one training step kept in a backend's memory, so that a device step needs no
// wait for the host between its forward and its update (src/train/device_step.cpp): a float
// array of step::kCount, in this order. The host writes the optimizer's factors before the
// update; the kernels write the loss, the norm, the clip scale and the verdict during it; the host
// reads them back after it. C++17 (nvcc compiles it).
#pragma once

namespace attnres::step {

enum Scalar : int {
  kLoss,       // sum of the micro-batches' mean losses (kernels add to it)
  kNorm,       // the gradients' L2 norm (written by grad_norm_clip)
  kClip,       // the factor the gradients are multiplied by (1 unless clipped)
  kOk,         // 1 when the loss and the norm are finite, else 0 (the update is skipped)
  kMaxNorm,    // the clip threshold (0: no clipping)
  kLossCheck,  // 1: a non-finite loss skips the update too (one rank); 0: the norm alone decides
  kBeta1,      // AdamW's factors (ops::AdamStep): the host writes them before each update
  kBeta2,
  kStepSize,    // lr / (1 - beta1^t)
  kInvBc2Sqrt,  // 1 / sqrt(1 - beta2^t)
  kEps,
  kDecay,  // 1 - lr * weight_decay (tensors with weight decay)
  kCount
};

}  // namespace attnres::step
