#include "train/evaluate.hpp"

#include <algorithm>
#include <string>

#include "attnres/data.hpp"
#include "attnres/dist.hpp"
#include "attnres/error.hpp"
#include "attnres/model.hpp"

namespace attnres {

WindowLoss window_loss(Model& model, const TokenSpan& span, int64_t B, int64_t T,
                       int64_t max_batches, dist::Communicator& comm, bool whole_batches,
                       const std::function<void(int64_t, int64_t, double)>& on_batch) {
  const int64_t windows = span.num_windows(T);
  check(windows >= 1, "the split has " + std::to_string(span.size()) +
                          " tokens, fewer than seq_len + 1; use a larger corpus, a larger "
                          "--val-fraction or a smaller --seq-len");
  check(B >= 1 && max_batches >= 1, "internal: evaluation of an empty batch");
  // (max_batches and B are bounded by their options, so the product fits)
  const int64_t used = std::min(windows, max_batches * B);
  const int64_t batches = (used + B - 1) / B;
  const int64_t ranks = comm.size();
  // Each rank's rows of batch i: whole batches, every ranks-th; or a slice of each.
  const int64_t slice = whole_batches ? B : B / ranks;
  const int64_t row0 = whole_batches ? 0 : comm.rank() * slice;
  Batch batch;
  double sum = 0.0;  // of the windows' mean losses
  int64_t done = 0;  // windows this rank evaluated
  for (int64_t i = whole_batches ? comm.rank() : 0; i < batches; i += whole_batches ? ranks : 1) {
    const int64_t first = i * B + row0;
    const int64_t n = std::clamp(used - first, int64_t{0}, slice);
    if (n > 0) {
      span.window_batch(first, n, T, batch);
      sum +=
          model.forward(batch.inputs.data(), batch.targets.data(), n, T) * static_cast<double>(n);
      done += n;
    }
    if (on_batch) on_batch(i + 1, batches, sum / static_cast<double>(std::max<int64_t>(done, 1)));
  }
  if (ranks > 1) comm.allreduce_sum(&sum, 1);
  return {sum / static_cast<double>(used), used};
}

}  // namespace attnres
