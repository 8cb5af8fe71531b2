// The validation loss: the mean loss over the first max_batches * B windows of a split (all of
// them when there are fewer), each window counted once: the last batch is cut short rather than
// wrapped around to windows already counted. Data parallel: each rank evaluates its slice of
// every batch. Pipeline (every rank holds all the weights; whole_batches): each rank evaluates
// whole batches, every ranks-th one.
#pragma once

#include <cstdint>
#include <functional>

namespace attnres {

class Model;
class TokenSpan;
namespace dist {
class Communicator;
}

struct WindowLoss {
  double loss = 0.0;    // mean over the windows' tokens
  int64_t windows = 0;  // windows evaluated (each of T tokens)
};

// on_batch (one process): after each batch, the batches done, their number and the mean so far.
WindowLoss window_loss(Model& model, const TokenSpan& span, int64_t B, int64_t T,
                       int64_t max_batches, dist::Communicator& comm, bool whole_batches,
                       const std::function<void(int64_t, int64_t, double)>& on_batch = {});

inline double validation_loss(Model& model, const TokenSpan& val, int64_t B, int64_t T,
                              int64_t max_batches, dist::Communicator& comm, bool whole_batches) {
  return window_loss(model, val, B, T, max_batches, comm, whole_batches).loss;
}

}  // namespace attnres
