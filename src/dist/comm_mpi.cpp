// The MPI communicator (attnres/dist.hpp), compiled when CMake finds MPI (ATTNRES_MPI=ON).
//
// MPI_COMM_WORLD (or a split of it) with the C API. Each collective registers itself with a
// watchdog thread; when one waits longer than timeout() the watchdog prints which collective hung
// and aborts the whole job (MPI_Abort with MPI_THREAD_MULTIPLE, else _exit, which mpirun also turns
// into a job abort).
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "attnres/dist.hpp"
#include "attnres/error.hpp"

namespace attnres::dist {

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator() {
    int inited = 0;
    MPI_Initialized(&inited);
    check(!inited, "internal: MPI initialised twice (create one communicator per process)");
    // MULTIPLE so the watchdog thread may call MPI_Abort while the main thread is blocked.
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &thread_level_);
    comm_ = MPI_COMM_WORLD;
    start();
  }

  // A sub-communicator (split()): owns `comm`, which it frees.
  MpiCommunicator(MPI_Comm comm, int thread_level) : comm_(comm), thread_level_(thread_level) {
    start();
  }

  ~MpiCommunicator() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    watchdog_.join();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (comm_ != MPI_COMM_WORLD) {
      if (!finalized) MPI_Comm_free(&comm_);
      return;
    }
    if (!finalized) MPI_Finalize();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  void allreduce_sum(float* data, int64_t n) override { reduce(data, n, MPI_FLOAT); }
  void allreduce_sum(double* data, int64_t n) override { reduce(data, n, MPI_DOUBLE); }

  void allgather(float* data, const std::vector<int64_t>& counts) override {
    check(static_cast<int>(counts.size()) == size_,
          "internal: allgather with " + std::to_string(counts.size()) + " counts for " +
              std::to_string(size_) + " ranks");
    std::vector<int> n(counts.size()), displ(counts.size());
    int64_t off = 0;
    for (size_t r = 0; r < counts.size(); r++) {
      check(off + counts[r] <= INT_MAX,
            "all-gather of more than 2^31 floats is not supported (the MPI counts are int)");
      n[r] = static_cast<int>(counts[r]);
      displ[r] = static_cast<int>(off);
      off += counts[r];
    }
    Op op(*this, "allgather");
    MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, n.data(), displ.data(), MPI_FLOAT,
                   comm_);
  }

  void reduce_scatter_sum(float* data, const std::vector<int64_t>& counts) override {
    check(static_cast<int>(counts.size()) == size_,
          "internal: reduce_scatter with " + std::to_string(counts.size()) + " counts for " +
              std::to_string(size_) + " ranks");
    std::vector<int> n(counts.size());
    int64_t total = 0, off = 0;
    for (size_t r = 0; r < counts.size(); r++) {
      if (static_cast<int>(r) < rank_) off += counts[r];
      total += counts[r];
      n[r] = static_cast<int>(counts[r]);
    }
    check(total <= INT_MAX,
          "reduce-scatter of more than 2^31 floats is not supported (the MPI counts are int)");
    scatter_.resize(static_cast<size_t>(std::max(1, n[static_cast<size_t>(rank_)])));
    {
      Op op(*this, "reduce_scatter");
      MPI_Reduce_scatter(data, scatter_.data(), n.data(), MPI_FLOAT, MPI_SUM, comm_);
    }
    std::copy(scatter_.begin(), scatter_.begin() + n[static_cast<size_t>(rank_)], data + off);
  }

  void broadcast(void* data, int64_t bytes, int root) override {
    Op op(*this, "broadcast");
    char* p = static_cast<char*>(data);
    for (int64_t off = 0; off < bytes; off += INT_MAX) {
      MPI_Bcast(p + off, static_cast<int>(std::min<int64_t>(INT_MAX, bytes - off)), MPI_BYTE, root,
                comm_);
    }
  }

  void barrier() override {
    Op op(*this, "barrier");
    MPI_Barrier(comm_);
  }

  void send(const float* data, int64_t n, int peer, int tag) override {
    check_peer(peer);
    Op op(*this, "send");
    for (int64_t off = 0; off < n; off += chunk()) {
      MPI_Send(data + off, static_cast<int>(std::min(chunk(), n - off)), MPI_FLOAT, peer, tag,
               comm_);
    }
  }

  void recv(float* data, int64_t n, int peer, int tag) override {
    check_peer(peer);
    Op op(*this, "recv");
    for (int64_t off = 0; off < n; off += chunk()) {
      MPI_Recv(data + off, static_cast<int>(std::min(chunk(), n - off)), MPI_FLOAT, peer, tag,
               comm_, MPI_STATUS_IGNORE);
    }
  }

  int64_t isend(const float* data, int64_t n, int peer, int tag) override {
    check_peer(peer);
    const int64_t ticket = next_ticket_++;
    std::vector<MPI_Request>& reqs = pending_[ticket];
    for (int64_t off = 0; off < n; off += chunk()) {
      reqs.emplace_back();
      MPI_Isend(data + off, static_cast<int>(std::min(chunk(), n - off)), MPI_FLOAT, peer, tag,
                comm_, &reqs.back());
    }
    return ticket;
  }

  bool test_send(int64_t ticket) override {
    auto it = pending_.find(ticket);
    if (it == pending_.end()) return true;
    int done = 0;
    MPI_Testall(static_cast<int>(it->second.size()), it->second.data(), &done, MPI_STATUSES_IGNORE);
    if (done) pending_.erase(it);
    return done != 0;
  }

  void wait_send(int64_t ticket) override {
    auto it = pending_.find(ticket);
    if (it == pending_.end()) return;
    Op op(*this, "wait for a send");
    MPI_Waitall(static_cast<int>(it->second.size()), it->second.data(), MPI_STATUSES_IGNORE);
    pending_.erase(it);
  }

  void wait_sends() override {
    if (pending_.empty()) return;
    Op op(*this, "wait for sends");
    for (auto& [ticket, reqs] : pending_) {
      MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
    }
    pending_.clear();
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    MPI_Comm sub = MPI_COMM_NULL;
    {
      Op op(*this, "split");
      MPI_Comm_split(comm_, color, key, &sub);
    }
    auto c = std::make_unique<MpiCommunicator>(sub, thread_level_);
    c->set_timeout(timeout());
    c->set_bucket_elems(bucket_elems());
    return c;
  }

  [[noreturn]] void abort(int code) override {
    std::fflush(stdout);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);  // MPI_Abort does not return; this satisfies [[noreturn]]
  }

 private:
  void start() {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    watchdog_ = std::thread([this] { watch(); });
  }

  // Marks one blocking MPI call for the watchdog.
  struct Op {
    Op(MpiCommunicator& c, const char* name) : c_(c) {
      c_.op_name_.store(name);
      c_.op_timeout_.store(c_.timeout_s_);
      c_.op_start_ns_.store(now_ns());
    }
    ~Op() { c_.op_start_ns_.store(0); }
    MpiCommunicator& c_;
  };

  int64_t chunk() const { return std::min<int64_t>(bucket_elems_, INT_MAX); }

  void check_peer(int peer) const {
    check(peer >= 0 && peer < size_ && peer != rank_, "invalid peer rank " + std::to_string(peer) +
                                                          " for rank " + std::to_string(rank_) +
                                                          " of " + std::to_string(size_));
  }

  // Bucketed in-place sum: one MPI_Allreduce per bucket of bucket_elems() values.
  void reduce(void* data, int64_t n, MPI_Datatype type) {
    if (n <= 0) return;
    Op op(*this, "allreduce");
    const int64_t elem = type == MPI_DOUBLE ? 8 : 4;
    char* p = static_cast<char*>(data);
    for (int64_t off = 0; off < n; off += chunk()) {
      MPI_Allreduce(MPI_IN_PLACE, p + off * elem, static_cast<int>(std::min(chunk(), n - off)),
                    type, MPI_SUM, comm_);
    }
  }

  void watch() {
    std::unique_lock<std::mutex> lk(mu_);
    while (!cv_.wait_for(lk, std::chrono::milliseconds(200), [this] { return quit_; })) {
      const int64_t t0 = op_start_ns_.load();
      const double limit = op_timeout_.load();
      if (t0 == 0 || limit <= 0) continue;
      const double waited = static_cast<double>(now_ns() - t0) * 1e-9;
      if (waited < limit) continue;
      std::fflush(stdout);
      std::fprintf(stderr,
                   "\nerror: rank %d of %d waited %.0f s in MPI %s for the other ranks: one of "
                   "them died, hangs or cannot be reached (its host down or the network to it "
                   "cut). Aborting the job; the last complete checkpoint is intact "
                   "(resume with --resume). If a rank legitimately needs longer between steps "
                   "(slow checkpoint writes, large evaluations), raise --dist-timeout.\n",
                   rank_, size_, waited, op_name_.load());
      std::fflush(stderr);
      // (MPI_Abort may wait for a launcher it cannot reach: the process ends within 20 s anyway)
      std::thread([] {
        std::this_thread::sleep_for(std::chrono::seconds(20));
        std::_Exit(1);
      }).detach();
      if (thread_level_ >= MPI_THREAD_MULTIPLE) MPI_Abort(MPI_COMM_WORLD, 1);
      std::_Exit(1);
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, thread_level_ = MPI_THREAD_SINGLE;
  std::map<int64_t, std::vector<MPI_Request>> pending_;  // isend() tickets not yet completed
  std::vector<float> scatter_;                           // reduce_scatter_sum's received block
  int64_t next_ticket_ = 1;
  std::atomic<int64_t> op_start_ns_{0};
  std::atomic<double> op_timeout_{0.0};
  std::atomic<const char*> op_name_{""};
  std::mutex mu_;
  std::condition_variable cv_;
  bool quit_ = false;
  std::thread watchdog_;
};

}  // namespace

bool mpi_compiled() { return true; }

std::unique_ptr<Communicator> init_world() {
  if (launched_world_size() <= 1) return std::make_unique<SingleCommunicator>();
  auto c = std::make_unique<MpiCommunicator>();
  if (c->size() == 1) return std::make_unique<SingleCommunicator>();
  return c;
}

}  // namespace attnres::dist
