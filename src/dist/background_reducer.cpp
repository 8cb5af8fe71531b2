// BackgroundReducer (attnres/dist.hpp): collectives on a worker thread, in submission order.
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include "attnres/dist.hpp"

namespace attnres::dist {

struct BackgroundReducer::State {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  int64_t busy = 0;  // submitted and not finished
  bool quit = false;
  std::exception_ptr error;
  std::thread worker;

  void run() {
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      cv.wait(lk, [&] { return quit || !queue.empty(); });
      if (queue.empty()) return;
      const std::function<void()> collective = std::move(queue.front());
      queue.pop_front();
      const bool skip = error != nullptr;  // after an error, drain without communicating
      lk.unlock();
      std::exception_ptr e;
      if (!skip) {
        try {
          collective();
        } catch (...) {
          e = std::current_exception();
        }
      }
      lk.lock();
      if (e && !error) error = e;
      busy--;
      cv.notify_all();
    }
  }
};

BackgroundReducer::BackgroundReducer() : s_(std::make_unique<State>()) {
  s_->worker = std::thread([st = s_.get()] { st->run(); });
}

BackgroundReducer::~BackgroundReducer() {
  {
    std::unique_lock<std::mutex> lk(s_->mu);
    s_->cv.wait(lk, [&] { return s_->busy == 0; });
    s_->quit = true;
  }
  s_->cv.notify_all();
  s_->worker.join();
}

void BackgroundReducer::submit(std::function<void()> collective) {
  {
    std::lock_guard<std::mutex> lk(s_->mu);
    s_->queue.push_back(std::move(collective));
    s_->busy++;
  }
  s_->cv.notify_all();
}

void BackgroundReducer::wait() {
  std::unique_lock<std::mutex> lk(s_->mu);
  s_->cv.wait(lk, [&] { return s_->busy == 0; });
  if (s_->error) {
    std::exception_ptr e = s_->error;
    s_->error = nullptr;
    std::rethrow_exception(e);
  }
}

}  // namespace attnres::dist
