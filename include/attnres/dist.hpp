// attnres/dist.hpp — the communicator that multi-process (data-parallel) training runs over.
//
// One process per rank, all running the same program. A Communicator offers the few collectives
// training needs (sum-all-reduce, all-gather, broadcast, barrier), point-to-point float transfers
// (blocking, and non-blocking sends for the pipeline schedule, SPEC 5) and abort. Three
// implementations:
//   single  one process; collectives are no-ops (always available);
//   mpi     MPI_COMM_WORLD (compiled when CMake finds MPI, option ATTNRES_MPI; see
//           src/dist/comm_mpi.cpp). A watchdog aborts the whole job when one collective waits
//           longer than timeout() for the other ranks, so a dead or hung rank never hangs the rest;
//   local   ranks as threads of one process (make_local_group): the in-process stand-in that
//           tests run multi-rank code on without mpirun. A wait past timeout() throws Error.
//
// Every collective must be called by every rank in the same order; a rank that throws instead
// must call abort() (the CLI does), or the others wait until the watchdog fires.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace attnres {
class Backend;
}

namespace attnres::dist {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "single" or "mpi".
  virtual std::string backend() const = 0;

  // In-place element-wise sum over all ranks; every rank receives the same result. Large
  // buffers are reduced in buckets of bucket_elems() values.
  virtual void allreduce_sum(float* data, int64_t n) = 0;
  virtual void allreduce_sum(double* data, int64_t n) = 0;
  // In place: data holds size() consecutive blocks of counts[r] floats; rank r's own block is
  // copied into every other rank's buffer (ZeRO-1: each rank's updated parameter shard).
  virtual void allgather(float* data, const std::vector<int64_t>& counts) = 0;
  // In place: data holds size() consecutive blocks of counts[r] floats; on return this rank's
  // own block holds the element-wise sum over the ranks of that block (the other blocks are left
  // as they were or overwritten). ZeRO-1: each rank receives only its shard of the gradient
  // sum, half an all-reduce's traffic. At most 2^31 - 1 floats in all.
  virtual void reduce_scatter_sum(float* data, const std::vector<int64_t>& counts) = 0;
  // Copies `bytes` bytes at `data` from rank `root` to every other rank.
  virtual void broadcast(void* data, int64_t bytes, int root) = 0;
  virtual void barrier() = 0;
  // Point-to-point (blocking): n floats to / from rank `peer`, matched by `tag`. Messages from
  // one rank with one tag arrive in the order they were sent.
  virtual void send(const float* data, int64_t n, int peer, int tag) = 0;
  virtual void recv(float* data, int64_t n, int peer, int tag) = 0;
  // Non-blocking send: returns a ticket at once; `data` must stay valid and unchanged until the
  // send has completed (test_send true, wait_send or wait_sends returned).
  virtual int64_t isend(const float* data, int64_t n, int peer, int tag) = 0;
  // True once the ticket's send has completed (its buffer may be reused); never blocks.
  virtual bool test_send(int64_t ticket) = 0;
  // Waits until the ticket's send has completed.
  virtual void wait_send(int64_t ticket) = 0;
  // Waits until every isend() of this rank has completed.
  virtual void wait_sends() = 0;
  // Collective: the ranks that pass the same `color` form a new communicator, ranked by `key`
  // (then by rank here). It keeps this one's timeout and bucket size; destroy it before this one.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
  // Ends every rank of the job with exit status `code` (never returns).
  [[noreturn]] virtual void abort(int code) = 0;

  // Seconds one collective may wait for the other ranks before the job is aborted (0 = forever).
  double timeout() const { return timeout_s_; }
  void set_timeout(double seconds) { timeout_s_ = seconds; }
  // Values per all-reduce bucket.
  int64_t bucket_elems() const { return bucket_elems_; }
  void set_bucket_elems(int64_t n) { bucket_elems_ = n > 0 ? n : bucket_elems_; }

  // Convenience built on the primitives above.
  bool is_root() const { return rank() == 0; }
  // True on every rank when `flag` is true on any rank.
  bool any(bool flag);
  // Rank root's string on every rank.
  std::string broadcast_string(const std::string& s, int root = 0);
  // Throws Error (the same on every rank) unless `value` is equal on all ranks. The message names
  // `what` (e.g. "initial weights"), the ranks that differ and `fix`.
  void require_same(uint64_t value, const std::string& what, const std::string& fix);

 protected:
  double timeout_s_ = 300.0;
  int64_t bucket_elems_ = int64_t{1} << 22;  // 16 MiB of floats
};

// One process, no communication.
class SingleCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "single"; }
  void allreduce_sum(float*, int64_t) override {}
  void allreduce_sum(double*, int64_t) override {}
  void allgather(float*, const std::vector<int64_t>&) override {}
  void reduce_scatter_sum(float*, const std::vector<int64_t>&) override {}
  void broadcast(void*, int64_t, int) override {}
  void barrier() override {}
  // Throw Error: a single process has no peer.
  void send(const float*, int64_t, int, int) override;
  void recv(float*, int64_t, int, int) override;
  int64_t isend(const float* data, int64_t n, int peer, int tag) override {
    send(data, n, peer, tag);
    return 0;
  }
  bool test_send(int64_t) override { return true; }
  void wait_send(int64_t) override {}
  void wait_sends() override {}
  std::unique_ptr<Communicator> split(int, int) override {
    auto c = std::make_unique<SingleCommunicator>();
    c->set_timeout(timeout());
    c->set_bucket_elems(bucket_elems());
    return c;
  }
  [[noreturn]] void abort(int code) override;
};

// `size` communicators whose ranks are threads of this process (rank r is element r): run each
// rank's code on its own thread. Collectives sum in rank order, so results are deterministic.
// A send copies its data at once; with `rendezvous`, it instead completes only when received, and
// the receiver reads the sender's buffer then and throws Error if it changed after the send (a
// sender reusing a buffer too early), as MPI's large-message protocol would expose.
std::vector<std::unique_ptr<Communicator>> make_local_group(int size, bool rendezvous = false);

// Collectives run on a thread of their own, in the order they were handed over, so that the
// caller computes meanwhile (gradient buckets during the backward pass, as PyTorch DDP does).
// Every rank must submit the same sequence of collectives; while any is pending the caller must
// not use the communicator they use, nor touch their buffers. wait() returns when all are done
// and rethrows the first error (the collectives after it are dropped).
class BackgroundReducer {
 public:
  BackgroundReducer();
  ~BackgroundReducer();  // waits for the pending ones
  BackgroundReducer(const BackgroundReducer&) = delete;
  BackgroundReducer& operator=(const BackgroundReducer&) = delete;
  void submit(std::function<void()> collective);
  void wait();

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// Sums buffers that live in a backend's memory (a model's gradients) over the ranks of `comm`,
// in place. Three methods:
//   direct  host memory (cpu, cuda-host): comm's own all-reduce;
//   nccl    GPU memory, NCCL all-reduce on the device (CUDA builds; libnccl.so.2 is loaded at run
//           time, so only runs that need it need it);
//   staged  GPU memory without NCCL: bucket by bucket through a host buffer and comm.
// make_device_reducer picks direct for host memory, else nccl when it loads, else staged (and
// says why in *note); ATTNRES_DEVICE_REDUCE=direct|staged|nccl forces one (tests).
class DeviceReducer {
 public:
  virtual ~DeviceReducer() = default;
  virtual void allreduce_sum(float* data, int64_t n) = 0;
  virtual std::string method() const = 0;
};
std::unique_ptr<DeviceReducer> make_device_reducer(Communicator& comm, Backend& be,
                                                   std::string* note = nullptr);

// This process's index among the ranks on its host (launcher environment; 0 when unknown): which
// GPU a rank takes.
int local_rank();

// True when this build has the MPI backend (CMake found MPI and ATTNRES_MPI is ON).
bool mpi_compiled();

// Number of ranks the launcher (mpirun / srun with PMI/PMIx) started, from its environment;
// 1 when not launched by one.
int launched_world_size();

// The process's communicator: MPI when launched by mpirun with more than one rank (MPI is
// initialised here and finalised when the communicator is destroyed; create at most one),
// otherwise a SingleCommunicator. Error if launched with several ranks but built without MPI.
std::unique_ptr<Communicator> init_world();

}  // namespace attnres::dist
