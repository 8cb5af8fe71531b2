// A helper for tests/test_dist.cpp, run under mpirun: exercises the process's communicator.
//   dist_check collectives   allreduce, broadcast, any, require_same, send/recv on known data;
//                            prints "rank R of N: ok" and exits 0, or names the mismatch, exit 1
//   dist_check hang SECONDS  rank 0 enters a barrier with a SECONDS watchdog timeout while the
//                            other ranks sleep: the watchdog must abort the job
//   dist_check bench N       times the all-reduce of N floats (a model's gradient), for the docs
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "attnres/dist.hpp"
#include "attnres/error.hpp"

using attnres::dist::Communicator;

namespace {

int failures = 0;

void expect(bool ok, const Communicator& c, const std::string& what) {
  if (ok) return;
  std::fprintf(stderr, "rank %d: FAILED: %s\n", c.rank(), what.c_str());
  failures++;
}

void collectives(Communicator& c) {
  const int R = c.size(), me = c.rank();
  // Buckets of 7 values, so a 1000-value reduction takes many MPI calls and a partial last one.
  c.set_bucket_elems(7);
  const int64_t n = 1000;
  std::vector<float> f(n);
  std::vector<double> d(n);
  for (int64_t i = 0; i < n; i++) {
    f[i] = static_cast<float>((me + 1) * (i + 1)) * 0.5f;  // exact in float
    d[i] = (me + 1) * 1e-3 * static_cast<double>(i) - static_cast<double>(me);
  }
  c.allreduce_sum(f.data(), n);
  c.allreduce_sum(d.data(), n);
  const double ranks_sum = R * (R + 1) / 2.0;  // sum of (me + 1)
  for (int64_t i = 0; i < n; i++) {
    const double want_f = ranks_sum * static_cast<double>(i + 1) * 0.5;
    const double want_d = ranks_sum * 1e-3 * static_cast<double>(i) - (R - 1) * R / 2.0;
    if (f[i] != static_cast<float>(want_f) || std::abs(d[i] - want_d) > 1e-9) {
      expect(false, c, "allreduce element " + std::to_string(i) + ": float " +
                           std::to_string(f[i]) + " (want " + std::to_string(want_f) +
                           "), double " + std::to_string(d[i]) + " (want " +
                           std::to_string(want_d) + ")");
      break;
    }
  }
  // Broadcast from the last rank, including a payload larger than one bucket.
  const std::string msg = c.broadcast_string(me == R - 1 ? std::string(100, 'x') + "from last" : "",
                                             R - 1);
  expect(msg == std::string(100, 'x') + "from last", c, "broadcast_string got '" + msg + "'");
  expect(c.any(me == 1), c, "any(true on rank 1) was false");
  expect(!c.any(false), c, "any(false everywhere) was true");
  c.require_same(42, "answer", "fix");  // equal everywhere: no error
  try {
    c.require_same(me == 1 ? 7 : 42, "test value", "make them equal");
    expect(false, c, "require_same accepted differing values");
  } catch (const attnres::Error& e) {
    const std::string w = e.what();
    expect(w.find("rank(s) 1 differ") != std::string::npos && w.find("make them equal") !=
                                                                   std::string::npos,
           c, "require_same message: " + w);
  }
  // Point-to-point: rank 0 sends 10 values to rank 1, which adds 1 and sends them back.
  std::vector<float> p(10);
  for (int i = 0; i < 10; i++) p[i] = static_cast<float>(i);
  if (me == 0) {
    c.send(p.data(), 10, 1, 5);
    c.recv(p.data(), 10, 1, 6);
    for (int i = 0; i < 10; i++) expect(p[i] == i + 1.0f, c, "send/recv round trip");
  } else if (me == 1) {
    c.recv(p.data(), 10, 0, 5);
    for (float& x : p) x += 1.0f;
    c.send(p.data(), 10, 0, 6);
  }
  // All-gather: rank r fills its block of r + 3 values with 100 r + i; everyone gets all blocks.
  std::vector<int64_t> counts;
  int64_t total = 0;
  for (int r = 0; r < R; r++) total += counts.emplace_back(r + 3);
  std::vector<float> all(static_cast<size_t>(total), -1.0f);
  int64_t off = 0;
  for (int r = 0; r < me; r++) off += counts[static_cast<size_t>(r)];
  for (int i = 0; i < me + 3; i++) all[static_cast<size_t>(off + i)] = 100.0f * me + i;
  c.allgather(all.data(), counts);
  off = 0;
  for (int r = 0; r < R; r++) {
    for (int i = 0; i < r + 3; i++) {
      expect(all[static_cast<size_t>(off + i)] == 100.0f * r + i, c,
             "allgather block " + std::to_string(r) + " value " + std::to_string(i));
    }
    off += r + 3;
  }
  c.barrier();
  if (failures == 0) std::printf("rank %d of %d: ok (%s)\n", me, R, c.backend().c_str());
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    auto c = attnres::dist::init_world();
    if (mode == "collectives") {
      collectives(*c);
    } else if (mode == "hang" && argc > 2) {
      c->set_timeout(std::atof(argv[2]));
      if (c->rank() == 0) {
        c->barrier();  // the others never arrive
        std::printf("rank 0: barrier returned although the other ranks never entered it\n");
        return 1;
      }
      ::sleep(120);
      return 1;
    } else if (mode == "bench" && argc > 2) {
      const int64_t n = std::atoll(argv[2]);
      std::vector<float> g(static_cast<size_t>(n), 1.0f);
      c->allreduce_sum(g.data(), n);  // warm-up
      const int reps = 20;
      c->barrier();
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < reps; i++) c->allreduce_sum(g.data(), n);
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (c->rank() == 0) {
        std::printf("allreduce of %lld floats (%.1f MiB) over %d ranks: %.2f ms\n",
                    static_cast<long long>(n), static_cast<double>(n) * 4 / 1048576, c->size(),
                    ms / reps);
      }
    } else {
      std::fprintf(stderr, "usage: dist_check collectives | hang SECONDS | bench N\n");
      return 2;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  std::fflush(stdout);
  return failures == 0 ? 0 : 1;
}
