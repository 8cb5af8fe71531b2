#include "train/evaluate.hpp"

#include <algorithm>
#include <string>

#include "attnres/data.hpp"
#include "attnres/dist.hpp"
#include "attnres/error.hpp"
#include "attnres/model.hpp"

namespace attnres {

double validation_loss(Model& model, const TokenSpan& val, int64_t B, int64_t T,
                       int64_t max_batches, dist::Communicator& comm, bool whole_batches) {
  const int64_t windows = val.num_windows(T);
  check(windows >= 1, "validation split has " + std::to_string(val.size()) +
                          " tokens, fewer than seq_len + 1; use a larger corpus, a larger "
                          "--val-fraction or a smaller --seq-len");
  const int64_t batches = std::min(max_batches, (windows + B - 1) / B);
  const int64_t ranks = comm.size();
  Batch batch;
  double total = 0.0;
  if (whole_batches) {
    for (int64_t i = comm.rank(); i < batches; i += ranks) {
      val.window_batch(i * B, B, T, batch);
      total += model.forward(batch.inputs.data(), batch.targets.data(), B, T);
    }
    if (ranks > 1) comm.allreduce_sum(&total, 1);
    return total / static_cast<double>(batches);
  }
  const int64_t rows = B / ranks, row0 = comm.rank() * rows;
  for (int64_t i = 0; i < batches; i++) {
    val.window_batch(i * B + row0, rows, T, batch);
    total += model.forward(batch.inputs.data(), batch.targets.data(), rows, T);
  }
  if (ranks > 1) {
    comm.allreduce_sum(&total, 1);  // equal slices: the batch mean is the mean of the rank means
    total /= static_cast<double>(ranks);
  }
  return total / static_cast<double>(batches);
}

}  // namespace attnres
