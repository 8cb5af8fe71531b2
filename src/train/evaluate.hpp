// The validation loss during training: the mean over up to max_batches batches of consecutive
// windows of the validation split. Data parallel: each rank evaluates its slice of every batch.
// Pipeline (every rank holds all the weights; whole_batches): each rank evaluates whole batches,
// every ranks-th one.
#pragma once

#include <cstdint>

namespace attnres {

class Model;
class TokenSpan;
namespace dist {
class Communicator;
}

double validation_loss(Model& model, const TokenSpan& val, int64_t B, int64_t T,
                       int64_t max_batches, dist::Communicator& comm, bool whole_batches);

}  // namespace attnres
