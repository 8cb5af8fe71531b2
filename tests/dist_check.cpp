// A helper for tests/test_dist.cpp, run under mpirun: exercises the process's communicator.
//   dist_check collectives   allreduce, reduce-scatter, broadcast, any, require_same, send/recv on
//   known data;
//                            prints "rank R of N: ok" and exits 0, or names the mismatch, exit 1
//   dist_check hang SECONDS  rank 0 enters a barrier with a SECONDS watchdog timeout while the
//                            other ranks sleep: the watchdog must abort the job
//   dist_check bench N       times the all-reduce of N floats (a model's gradient), for the docs
//   dist_check pipeline V SCHEME  one pipeline step (SPEC 5) of a tiny Block AttnRes model over
//                            the ranks with V virtual stages: the summed gradients and the loss
//                            must equal the one-process gradient accumulation each rank computes
//                            itself (2e-6 relative); prints "rank R: pipeline ok, B bytes sent"
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "attnres/dist.hpp"
#include "attnres/error.hpp"
#include "attnres/model.hpp"
#include "attnres/pipeline.hpp"

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
      expect(false, c,
             "allreduce element " + std::to_string(i) + ": float " + std::to_string(f[i]) +
                 " (want " + std::to_string(want_f) + "), double " + std::to_string(d[i]) +
                 " (want " + std::to_string(want_d) + ")");
      break;
    }
  }
  // Reduce-scatter with uneven blocks, one of them empty: each rank's own block summed.
  {
    std::vector<int64_t> counts(static_cast<size_t>(R));
    for (int r = 0; r < R; r++) counts[static_cast<size_t>(r)] = r == 1 ? 0 : 5 + 3 * r;
    int64_t total = 0, off = 0;
    for (int r = 0; r < R; r++) {
      if (r < me) off += counts[static_cast<size_t>(r)];
      total += counts[static_cast<size_t>(r)];
    }
    std::vector<float> g(static_cast<size_t>(total));
    for (int64_t i = 0; i < total; i++) g[i] = static_cast<float>((me + 1) * (i + 1));
    c.reduce_scatter_sum(g.data(), counts);
    for (int64_t i = off; i < off + counts[static_cast<size_t>(me)]; i++) {
      if (g[i] != static_cast<float>(ranks_sum * static_cast<double>(i + 1))) {
        expect(false, c,
               "reduce_scatter element " + std::to_string(i) + ": " + std::to_string(g[i]));
        break;
      }
    }
  }
  // Broadcast from the last rank, including a payload larger than one bucket.
  const std::string msg =
      c.broadcast_string(me == R - 1 ? std::string(100, 'x') + "from last" : "", R - 1);
  expect(msg == std::string(100, 'x') + "from last", c, "broadcast_string got '" + msg + "'");
  expect(c.any(me == 1), c, "any(true on rank 1) was false");
  expect(!c.any(false), c, "any(false everywhere) was true");
  c.require_same(42, "answer", "fix");  // equal everywhere: no error
  try {
    c.require_same(me == 1 ? 7 : 42, "test value", "make them equal");
    expect(false, c, "require_same accepted differing values");
  } catch (const attnres::Error& e) {
    const std::string w = e.what();
    expect(w.find("rank(s) 1 differ") != std::string::npos &&
               w.find("make them equal") != std::string::npos,
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

void pipeline(Communicator& c, int64_t V, const std::string& scheme) {
  attnres::ModelConfig cfg;
  cfg.n_layer = 4;
  cfg.n_head = 2;
  cfg.d_model = 16;
  cfg.ffn_hidden = 32;
  cfg.vocab_size = 31;
  cfg.max_seq_len = 8;
  cfg.residual.mode = attnres::ResidualMode::block;
  cfg.residual.block_size = 2;
  const int64_t M = 4, B = 2, T = 8, N = B * T;
  std::vector<std::vector<int32_t>> in(M, std::vector<int32_t>(N)), tg = in;
  std::vector<const int32_t*> ip, tp;
  for (int64_t m = 0; m < M; m++) {
    for (int64_t i = 0; i < N; i++) {
      in[m][i] = static_cast<int32_t>((7 * m + 3 * i + 1) % cfg.vocab_size);
      tg[m][i] = static_cast<int32_t>((5 * m + 11 * i + 2) % cfg.vocab_size);
    }
    ip.push_back(in[m].data());
    tp.push_back(tg[m].data());
  }
  attnres::Model ref(cfg), piped(cfg);
  ref.init_weights(3);
  piped.init_weights(3);
  ref.zero_grad();
  piped.zero_grad();
  double want = 0;
  for (int64_t m = 0; m < M; m++) {
    want += ref.forward(ip[m], tp[m], B, T);
    ref.backward();
  }
  namespace pipe = attnres::pipe;
  pipe::Pipeline pl(piped, c, pipe::make_plan(piped, c.size(), V, M), pipe::parse_scheme(scheme));
  double loss = pl.step(ip, tp, B, T);
  const int64_t n = piped.layout().total();
  c.allreduce_sum(piped.grads(), n);
  c.allreduce_sum(&loss, 1);
  double diff = 0, scale = 1e-30;
  for (int64_t i = 0; i < n; i++) {
    diff = std::max(diff, std::abs(double(piped.grads()[i]) - ref.grads()[i]));
    scale = std::max(scale, std::abs(double(ref.grads()[i])));
  }
  expect(diff <= 2e-6 * scale, c, "pipeline gradients differ by " + std::to_string(diff / scale));
  expect(std::abs(loss - want) <= 1e-6 * std::abs(want), c,
         "pipeline loss " + std::to_string(loss) + " != " + std::to_string(want));
  const pipe::Traffic& t = pl.traffic();
  if (failures == 0) {
    std::printf("rank %d: pipeline ok, %lld bytes sent\n", c.rank(),
                static_cast<long long>(t.forward_bytes + t.backward_bytes));
  }
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
    } else if (mode == "pipeline" && argc > 3) {
      pipeline(*c, std::atoll(argv[2]), argv[3]);
    } else {
      std::fprintf(stderr,
                   "usage: dist_check collectives | hang SECONDS | bench N | pipeline V SCHEME\n");
      return 2;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  std::fflush(stdout);
  return failures == 0 ? 0 : 1;
}
