// The in-process communicator (attnres/dist.hpp, make_local_group): ranks are threads sharing one
// mailbox. A send copies its data at once, or in rendezvous mode hands over its buffer, which the
// receiver reads (and checks unchanged) when it receives, as MPI does with large messages. Tests
// run multi-rank code (the pipeline schedule, data-parallel steps) on it without mpirun, under the
// sanitizers too. Collectives are rendezvous on a generation barrier: every rank posts its buffer,
// then each reads the others' in rank order (deterministic sums).
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "attnres/dist.hpp"
#include "attnres/error.hpp"

namespace attnres::dist {

namespace {

struct Shared {
  Shared(int n, bool rv) : size(n), rendezvous(rv), slots(static_cast<size_t>(n), nullptr) {}
  const int size;
  const bool rendezvous;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  std::vector<const void*> slots;  // each rank's buffer during a collective
  // A message: copied at send time, or (rendezvous) the sender's buffer, read when received, with
  // a copy taken at send time to prove the sender did not change it meanwhile.
  struct Msg {
    std::vector<float> data;     // the copy
    const float* src = nullptr;  // rendezvous: the sender's buffer
    std::shared_ptr<bool> done;  // rendezvous: set when received
  };
  std::map<std::tuple<int, int, int>, std::deque<Msg>> box;  // (from, to, tag)
  std::map<int, std::shared_ptr<Shared>> made;               // split(): the new groups by color
};

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<Shared> sh, int rank) : sh_(std::move(sh)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return sh_->size; }
  std::string backend() const override { return "local"; }

  void allreduce_sum(float* data, int64_t n) override { reduce(data, n); }
  void allreduce_sum(double* data, int64_t n) override { reduce(data, n); }

  void allgather(float* data, const std::vector<int64_t>& counts) override {
    check(static_cast<int>(counts.size()) == size(), "internal: allgather counts != ranks");
    post(data);
    int64_t off = 0;
    for (int r = 0; r < size(); r++) {
      const int64_t c = counts[static_cast<size_t>(r)];
      if (r != rank_) {
        std::memcpy(data + off, static_cast<const float*>(slot(r)) + off, sizeof(float) * c);
      }
      off += c;
    }
    sync("allgather");
  }

  void reduce_scatter_sum(float* data, const std::vector<int64_t>& counts) override {
    check(static_cast<int>(counts.size()) == size(), "internal: reduce_scatter counts != ranks");
    int64_t off = 0;
    for (int r = 0; r < rank_; r++) off += counts[static_cast<size_t>(r)];
    const int64_t n = counts[static_cast<size_t>(rank_)];
    post(data);
    std::vector<float> sum(static_cast<size_t>(n), 0.0f);
    for (int r = 0; r < size(); r++) {
      const float* p = static_cast<const float*>(slot(r)) + off;
      for (int64_t i = 0; i < n; i++) sum[static_cast<size_t>(i)] += p[i];
    }
    sync("reduce_scatter");  // every rank has read every buffer
    std::memcpy(data + off, sum.data(), sizeof(float) * static_cast<size_t>(n));
  }

  void broadcast(void* data, int64_t bytes, int root) override {
    post(data);
    if (rank_ != root) std::memcpy(data, slot(root), static_cast<size_t>(bytes));
    sync("broadcast");
  }

  void barrier() override { sync("barrier"); }

  void send(const float* data, int64_t n, int peer, int tag) override {
    wait_send(isend(data, n, peer, tag));
  }

  int64_t isend(const float* data, int64_t n, int peer, int tag) override {
    check_peer(peer);
    Shared::Msg m;
    m.data.assign(data, data + n);
    if (sh_->rendezvous) {
      std::lock_guard<std::mutex> lk(sh_->mu);
      for (const auto& [t, p] : pending_) {  // a buffer sent again before its first send completed
        check(*p.done || data + n <= p.data || p.data + p.n <= data,
              "local rank " + std::to_string(rank_) +
                  " sends from a buffer whose earlier send "
                  "(to rank " +
                  std::to_string(p.peer) + ") is still in flight");
      }
      m.src = data;
      m.done = std::make_shared<bool>(false);
      pending_[next_ticket_] = {m.done, data, n, peer};
    }
    {
      std::lock_guard<std::mutex> lk(sh_->mu);
      sh_->box[{rank_, peer, tag}].push_back(std::move(m));
    }
    sh_->cv.notify_all();
    return next_ticket_++;
  }

  bool test_send(int64_t ticket) override {
    std::lock_guard<std::mutex> lk(sh_->mu);
    auto it = pending_.find(ticket);
    if (it == pending_.end() || *it->second.done) {
      if (it != pending_.end()) pending_.erase(it);
      return true;
    }
    return false;
  }

  void wait_send(int64_t ticket) override {
    std::unique_lock<std::mutex> lk(sh_->mu);
    auto it = pending_.find(ticket);
    if (it == pending_.end()) return;
    const std::shared_ptr<bool> done = it->second.done;
    wait(
        lk, [&] { return *done; }, "wait_send");
    pending_.erase(ticket);
  }

  void wait_sends() override {
    while (!pending_.empty()) wait_send(pending_.begin()->first);
  }

  void recv(float* data, int64_t n, int peer, int tag) override {
    check_peer(peer);
    std::unique_lock<std::mutex> lk(sh_->mu);
    auto& q = sh_->box[{peer, rank_, tag}];
    wait(
        lk, [&] { return !q.empty(); }, "recv");
    Shared::Msg m = std::move(q.front());
    q.pop_front();
    check(static_cast<int64_t>(m.data.size()) == n,
          "local rank " + std::to_string(rank_) + " expected " + std::to_string(n) +
              " floats from rank " + std::to_string(peer) + " (tag " + std::to_string(tag) +
              ") but the message has " + std::to_string(m.data.size()));
    if (m.src) {  // rendezvous: read the sender's buffer now, as MPI would for a large message
      const bool changed = std::memcmp(m.src, m.data.data(), sizeof(float) * n) != 0;
      std::memcpy(data, m.src, sizeof(float) * n);
      *m.done = true;
      sh_->cv.notify_all();
      check(!changed, "local rank " + std::to_string(peer) +
                          " changed the buffer of a message "
                          "to rank " +
                          std::to_string(rank_) + " (tag " + std::to_string(tag) +
                          ") while its send was in flight");
      return;
    }
    std::memcpy(data, m.data.data(), sizeof(float) * n);
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    const int mine[2] = {color, key};
    post(mine);
    std::vector<std::pair<int, int>> members;  // (key, rank) of my color
    std::map<int, int> sizes;                  // color -> ranks
    for (int r = 0; r < size(); r++) {
      const int* p = static_cast<const int*>(slot(r));
      sizes[p[0]]++;
      if (p[0] == color) members.emplace_back(p[1], r);
    }
    std::sort(members.begin(), members.end());
    const int new_rank = static_cast<int>(
        std::find(members.begin(), members.end(), std::make_pair(key, rank_)) - members.begin());
    if (rank_ == 0) {
      std::lock_guard<std::mutex> lk(sh_->mu);
      sh_->made.clear();
      for (const auto& [c, n] : sizes) sh_->made[c] = std::make_shared<Shared>(n, sh_->rendezvous);
    }
    sync("split");  // the groups exist; every rank has read the colors
    std::shared_ptr<Shared> group;
    {
      std::lock_guard<std::mutex> lk(sh_->mu);
      group = sh_->made.at(color);
    }
    sync("split");  // every rank has its group (rank 0 may clear them at the next split)
    auto c = std::make_unique<LocalCommunicator>(group, new_rank);
    c->set_timeout(timeout());
    c->set_bucket_elems(bucket_elems());
    return c;
  }

  [[noreturn]] void abort(int code) override {
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(code);
  }

 private:
  void check_peer(int peer) const {
    check(peer >= 0 && peer < size() && peer != rank_,
          "invalid peer rank " + std::to_string(peer) + " for local rank " + std::to_string(rank_) +
              " of " + std::to_string(size()));
  }

  template <class Pred>
  void wait(std::unique_lock<std::mutex>& lk, Pred done, const char* what) {
    const double t = timeout();
    if (t <= 0) {
      sh_->cv.wait(lk, done);
      return;
    }
    if (!sh_->cv.wait_for(lk, std::chrono::duration<double>(t), done)) {
      throw Error("local rank " + std::to_string(rank_) + " waited " + std::to_string(t) +
                  " s in " + what + " for the other ranks");
    }
  }

  // Generation barrier.
  void sync(const char* what) {
    std::unique_lock<std::mutex> lk(sh_->mu);
    const uint64_t gen = sh_->generation;
    if (++sh_->arrived == sh_->size) {
      sh_->arrived = 0;
      sh_->generation++;
      sh_->cv.notify_all();
      return;
    }
    wait(
        lk, [&] { return sh_->generation != gen; }, what);
  }

  void post(const void* data) {
    {
      std::lock_guard<std::mutex> lk(sh_->mu);
      sh_->slots[static_cast<size_t>(rank_)] = data;
    }
    sync("collective");
  }
  const void* slot(int r) {
    std::lock_guard<std::mutex> lk(sh_->mu);
    return sh_->slots[static_cast<size_t>(r)];
  }

  template <class T>
  void reduce(T* data, int64_t n) {
    post(data);
    std::vector<T> sum(static_cast<size_t>(n), T(0));
    for (int r = 0; r < size(); r++) {
      const T* p = static_cast<const T*>(slot(r));
      for (int64_t i = 0; i < n; i++) sum[static_cast<size_t>(i)] += p[i];
    }
    sync("allreduce");  // every rank has read every buffer
    std::memcpy(data, sum.data(), sizeof(T) * static_cast<size_t>(n));
  }

  std::shared_ptr<Shared> sh_;
  const int rank_;
  struct Pending {
    std::shared_ptr<bool> done;
    const float* data;
    int64_t n;
    int peer;
  };
  std::map<int64_t, Pending> pending_;  // rendezvous: this rank's sends not yet waited for
  int64_t next_ticket_ = 1;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_local_group(int size, bool rendezvous) {
  check(size >= 1, "a local group needs at least one rank");
  auto sh = std::make_shared<Shared>(size, rendezvous);
  std::vector<std::unique_ptr<Communicator>> g;
  for (int r = 0; r < size; r++) g.push_back(std::make_unique<LocalCommunicator>(sh, r));
  return g;
}

}  // namespace attnres::dist
