// The op table (in the spirit of ggml's test-backend-ops): one table of op cases (op, shape,
// options, tolerances), each checked on every backend (cpu, cuda-host, cuda where a GPU is
// present) in three ways:
//   1. the backend's forward against a plain reference written here in double (loops straight
//      from the op's definition in src/ops/ops.hpp, sharing no code with the ops);
//   2. the backend's backward against central finite differences of that reference, on the
//      scalar loss sum(R * out) for a random R, at up to kSamples elements of every input;
//   3. the backward's accumulation: gradients land on top of what their buffers held (+=), or,
//      for the outputs documented as written, replace it.
// A failing case names its backend, op and shape in the test name. Adding an op: one entry in
// cases() (its inputs, reference, forward and backward on a Backend).
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "attnres/backend.hpp"
#include "attnres/error.hpp"
#include "backend/backend.hpp"
#include "test_util.hpp"

using namespace attnres;
using attnres::testing::randn;
using attnres::testing::rel_diff;

namespace {

using Ptrs = std::vector<float*>;
using HostIn = std::vector<const double*>;

struct Input {
  std::string name;
  int64_t n;
  double scale = 1.0, offset = 0.0;  // values: offset + scale * N(0,1)
  bool grad = true;                  // the backward computes its gradient
  bool written = false;              // the backward writes that gradient (not +=)
};

struct OpCase {
  std::string name;  // op and shape, e.g. "rmsnorm_N6_C16"
  std::vector<Input> in;
  int64_t n_out = 0;
  // The reference: out (n_out) from the inputs, in double.
  std::function<void(const HostIn&, double*)> ref;
  // The backend's forward: out (n_out, backend memory) from the inputs (backend memory).
  std::function<void(Backend&, const Ptrs&, float*)> fwd;
  // The backend's backward from dout (n_out): into din (null where an input has no gradient);
  // it may run the forward again for the state its backward reads.
  std::function<void(Backend&, const Ptrs&, const float*, const Ptrs&)> bwd;
  double fwd_tol = 1e-5, bwd_tol = 2e-3;
};

OpCase make_case(std::string name, std::vector<Input> in, int64_t n_out) {
  OpCase c;
  c.name = std::move(name);
  c.in = std::move(in);
  c.n_out = n_out;
  return c;
}

// A scratch buffer on `be` of n elements (zeroed). The lambdas that free one wait for the
// backend first (a device runs the queued ops later).
template <class T = float>
std::shared_ptr<DevBuf<T>> scratch(Backend& be, int64_t n) {
  auto b = std::make_shared<DevBuf<T>>();
  b->on(&be).resize(static_cast<size_t>(std::max<int64_t>(n, 1)));
  return b;
}
std::shared_ptr<DevBuf<int32_t>> upload_ids(Backend& be, const std::vector<int32_t>& ids) {
  auto b = scratch<int32_t>(be, static_cast<int64_t>(ids.size()));
  b->upload(ids.data(), ids.size());
  return b;
}
std::vector<int32_t> ids_below(int64_t n, int64_t V, int64_t mul) {
  std::vector<int32_t> r(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; i++) r[i] = static_cast<int32_t>((i * mul + 3) % V);
  return r;
}
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// ---- the cases ----

OpCase embedding_case(int64_t N, int64_t C, int64_t V) {
  const auto ids = ids_below(N, V, 5);  // repeats: the backward scatters more than once
  OpCase c = make_case("embedding_N" + std::to_string(N) + "_C" + std::to_string(C),
                       {{"wte", V * C}}, N * C);
  c.ref = [=](const HostIn& x, double* out) {
    for (int64_t n = 0; n < N; n++) {
      for (int64_t k = 0; k < C; k++) out[n * C + k] = x[0][ids[n] * C + k];
    }
  };
  c.fwd = [=](Backend& be, const Ptrs& x, float* out) {
    auto d = upload_ids(be, ids);
    be.embedding_forward(out, d->data(), x[0], N, C);
    be.synchronize();
  };
  c.bwd = [=](Backend& be, const Ptrs&, const float* dout, const Ptrs& dx) {
    auto d = upload_ids(be, ids);
    be.embedding_backward(dx[0], dout, d->data(), N, C, ids.data());
    be.synchronize();
  };
  return c;
}

OpCase rmsnorm_case(int64_t N, int64_t C) {
  const float eps = 1e-5f;
  OpCase c = make_case("rmsnorm_N" + std::to_string(N) + "_C" + std::to_string(C),
                       {{"inp", N * C}, {"g", C, 0.3, 1.0}}, N * C);
  c.ref = [=](const HostIn& x, double* out) {
    for (int64_t n = 0; n < N; n++) {
      double ms = 0;
      for (int64_t k = 0; k < C; k++) ms += x[0][n * C + k] * x[0][n * C + k];
      const double r = 1.0 / std::sqrt(ms / C + eps);
      for (int64_t k = 0; k < C; k++) out[n * C + k] = x[0][n * C + k] * r * x[1][k];
    }
  };
  c.fwd = [=](Backend& be, const Ptrs& x, float* out) {
    auto rstd = scratch(be, N);
    be.rmsnorm_forward(out, rstd->data(), x[0], x[1], N, C, eps);
    be.synchronize();
  };
  c.bwd = [=](Backend& be, const Ptrs& x, const float* dout, const Ptrs& dx) {
    auto out = scratch(be, N * C), rstd = scratch(be, N);
    be.rmsnorm_forward(out->data(), rstd->data(), x[0], x[1], N, C, eps);
    be.rmsnorm_backward(dx[0], dx[1], dout, x[0], x[1], rstd->data(), N, C);
    be.synchronize();
  };
  return c;
}

OpCase matmul_case(int64_t N, int64_t IC, int64_t OC) {
  OpCase c = make_case(
      "matmul_N" + std::to_string(N) + "_IC" + std::to_string(IC) + "_OC" + std::to_string(OC),
      {{"inp", N * IC}, {"w", OC * IC, 0.5}}, N * OC);
  c.ref = [=](const HostIn& x, double* out) {
    for (int64_t n = 0; n < N; n++) {
      for (int64_t o = 0; o < OC; o++) {
        double s = 0;
        for (int64_t i = 0; i < IC; i++) s += x[0][n * IC + i] * x[1][o * IC + i];
        out[n * OC + o] = s;
      }
    }
  };
  c.fwd = [=](Backend& be, const Ptrs& x, float* out) {
    be.matmul_forward(out, x[0], x[1], N, IC, OC);
  };
  c.bwd = [=](Backend& be, const Ptrs& x, const float* dout, const Ptrs& dx) {
    be.matmul_backward(dx[0], dx[1], dout, x[0], x[1], N, IC, OC);
  };
  return c;
}

// RoPE on rows of stride ld = heads * hd + 3 (a gap the op must leave alone), at pos0.
OpCase rope_case(int64_t B, int64_t T, int64_t heads, int64_t hd, int64_t pos0) {
  const double theta = 10000.0;
  const int64_t ld = heads * hd + 3, n = B * T * ld, half = hd / 2;
  std::vector<float> cs(static_cast<size_t>((pos0 + T) * half)), sn(cs.size());
  ops::rope_table(cs.data(), sn.data(), pos0 + T, hd, theta);
  OpCase c = make_case("rope_B" + std::to_string(B) + "_T" + std::to_string(T) + "_H" +
                           std::to_string(heads) + "_hd" + std::to_string(hd) + "_pos" +
                           std::to_string(pos0),
                       {{"x", n}}, n);
  c.ref = [=](const HostIn& x, double* out) {
    for (int64_t i = 0; i < n; i++) out[i] = x[0][i];
    for (int64_t b = 0; b < B; b++) {
      for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < heads; h++) {
          const int64_t o = (b * T + t) * ld + h * hd;
          for (int64_t i = 0; i < half; i++) {
            const double a = double(pos0 + t) * std::pow(theta, -2.0 * double(i) / double(hd));
            const double x1 = x[0][o + i], x2 = x[0][o + i + half];
            out[o + i] = x1 * std::cos(a) - x2 * std::sin(a);
            out[o + i + half] = x2 * std::cos(a) + x1 * std::sin(a);
          }
        }
      }
    }
  };
  auto tables = [=](Backend& be) {
    auto t = scratch(be, 2 * static_cast<int64_t>(cs.size()));
    be.upload(t->data(), cs.data(), sizeof(float) * cs.size());
    be.upload(t->data() + cs.size(), sn.data(), sizeof(float) * sn.size());
    return t;
  };
  const auto half_n = static_cast<int64_t>(cs.size());
  c.fwd = [=](Backend& be, const Ptrs& x, float* out) {  // (in place: on a copy)
    auto t = tables(be);
    be.copy(out, x[0], sizeof(float) * n);
    be.rope_forward(out, t->data(), t->data() + half_n, B, T, heads, hd, ld, pos0);
    be.synchronize();
  };
  c.bwd = [=](Backend& be, const Ptrs&, const float* dout, const Ptrs& dx) {  // (in place)
    auto t = tables(be);
    auto g = scratch(be, n);
    be.copy(g->data(), dout, sizeof(float) * n);
    be.rope_backward(g->data(), t->data(), t->data() + half_n, B, T, heads, hd, ld, pos0);
    be.add(dx[0], dx[0], g->data(), n);
    be.synchronize();
  };
  return c;
}

OpCase attention_case(int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t hd) {
  const ops::AttnShape s{B, T, H, Hkv, hd};
  const int64_t ld = s.ld(), n_out = B * T * H * hd;
  OpCase c =
      make_case("attention_B" + std::to_string(B) + "_T" + std::to_string(T) + "_H" +
                    std::to_string(H) + "_Hkv" + std::to_string(Hkv) + "_hd" + std::to_string(hd),
                {{"qkv", B * T * ld, 0.7}}, n_out);
  c.ref = [=](const HostIn& x, double* out) {
    const double* qkv = x[0];
    const double scale = 1.0 / std::sqrt(double(hd));
    std::vector<double> p(static_cast<size_t>(T));
    for (int64_t b = 0; b < B; b++) {
      for (int64_t h = 0; h < H; h++) {
        const int64_t kh = h / (H / Hkv);  // the query head's key/value head
        for (int64_t t = 0; t < T; t++) {
          const double* q = qkv + (b * T + t) * ld + h * hd;
          double mx = -1e300, z = 0;
          for (int64_t u = 0; u <= t; u++) {
            const double* k = qkv + (b * T + u) * ld + (H + kh) * hd;
            double dot = 0;
            for (int64_t i = 0; i < hd; i++) dot += q[i] * k[i];
            p[u] = dot * scale;
            mx = std::max(mx, p[u]);
          }
          for (int64_t u = 0; u <= t; u++) z += (p[u] = std::exp(p[u] - mx));
          for (int64_t i = 0; i < hd; i++) {
            double acc = 0;
            for (int64_t u = 0; u <= t; u++)
              acc += p[u] / z * qkv[(b * T + u) * ld + (H + Hkv + kh) * hd + i];
            out[(b * T + t) * H * hd + h * hd + i] = acc;
          }
        }
      }
    }
  };
  c.fwd = [=](Backend& be, const Ptrs& x, float* out) {
    auto att = scratch(be, be.attention_state_floats(s));
    be.attention_forward(out, att->data(), x[0], s);
    be.synchronize();
  };
  c.bwd = [=](Backend& be, const Ptrs& x, const float* dout, const Ptrs& dx) {
    const int64_t na = be.attention_state_floats(s);
    auto out = scratch(be, n_out), att = scratch(be, na), tmp = scratch(be, na);
    be.attention_forward(out->data(), att->data(), x[0], s);
    be.attention_backward(dx[0], tmp->data(), dout, x[0], out->data(), att->data(), s);
    be.synchronize();
  };
  return c;
}

OpCase swiglu_case(int64_t N, int64_t F) {
  OpCase c = make_case("swiglu_N" + std::to_string(N) + "_F" + std::to_string(F),
                       {{"h13", N * 2 * F, 1.5}}, N * F);
  c.ref = [=](const HostIn& x, double* out) {
    for (int64_t n = 0; n < N; n++) {
      for (int64_t f = 0; f < F; f++) {
        const double h1 = x[0][n * 2 * F + f], h3 = x[0][n * 2 * F + F + f];
        out[n * F + f] = h1 * sigmoid(h1) * h3;
      }
    }
  };
  c.fwd = [=](Backend& be, const Ptrs& x, float* out) { be.swiglu_forward(out, x[0], N, F); };
  c.bwd = [=](Backend& be, const Ptrs& x, const float* dout, const Ptrs& dx) {
    be.swiglu_backward(dx[0], dout, x[0], N, F);
  };
  return c;
}

// The mean loss; its backward WRITES dlogits (ops.hpp: they may alias the logits).
OpCase cross_entropy_case(int64_t N, int64_t V) {
  const auto tg = ids_below(N, V, 7);
  OpCase c = make_case("cross_entropy_N" + std::to_string(N) + "_V" + std::to_string(V),
                       {{"logits", N * V, 2.0, 0.0, true, /*written=*/true}}, 1);
  c.ref = [=](const HostIn& x, double* out) {
    double sum = 0;
    for (int64_t n = 0; n < N; n++) {
      const double* l = x[0] + n * V;
      double mx = l[0], z = 0;
      for (int64_t v = 1; v < V; v++) mx = std::max(mx, l[v]);
      for (int64_t v = 0; v < V; v++) z += std::exp(l[v] - mx);
      sum += mx + std::log(z) - l[tg[n]];
    }
    out[0] = sum / double(N);
  };
  c.fwd = [=](Backend& be, const Ptrs& x, float* out) {
    auto lse = scratch(be, N);
    auto t = upload_ids(be, tg);
    const auto loss =
        static_cast<float>(be.cross_entropy_forward(lse->data(), x[0], t->data(), N, V));
    be.upload(out, &loss, sizeof(float));
    be.synchronize();
  };
  c.bwd = [=](Backend& be, const Ptrs& x, const float* dout, const Ptrs& dx) {
    auto lse = scratch(be, N);
    auto t = upload_ids(be, tg);
    be.cross_entropy_forward(lse->data(), x[0], t->data(), N, V);
    float dloss = 0;
    be.download(&dloss, dout, sizeof(float));
    // (the op's dloss scales each row: the mean's is dout / N)
    be.cross_entropy_backward(dx[0], x[0], lse->data(), t->data(), N, V, dloss / float(N));
    be.synchronize();
  };
  return c;
}

// The AttnRes depth mix in double, straight from SPEC 2: out (N,d) mixes the sources v (each
// (N,d)) with query q ((d), or row n at q + n q_ld), per head slice: scores q . v, divided by the
// key's RMS (key norm), through a softmax over the sources or a sigmoid each.
void ref_depth_mix(const HostIn& v, const double* q0, int64_t q_ld, int64_t N,
                   const ops::DepthMix& m, double* out) {
  const int64_t S = static_cast<int64_t>(v.size()), d = m.d, dh = m.dh();
  std::vector<double> a(static_cast<size_t>(S));
  for (int64_t n = 0; n < N; n++) {
    const double* q = q0 + n * q_ld;
    for (int64_t h = 0; h < m.H; h++) {
      double mx = -1e300;
      for (int64_t i = 0; i < S; i++) {
        const double* vi = v[i] + n * d + h * dh;
        double ms = 0, dot = 0;
        for (int64_t k = 0; k < dh; k++) {
          ms += vi[k] * vi[k];
          dot += q[h * dh + k] * vi[k];
        }
        a[i] = m.key_norm ? dot / std::sqrt(ms / dh + double(m.eps)) : dot;
        mx = std::max(mx, a[i]);
      }
      double z = 0;
      for (int64_t i = 0; i < S; i++) z += m.softmax ? std::exp(a[i] - mx) : 0.0;
      for (int64_t i = 0; i < S; i++) a[i] = m.softmax ? std::exp(a[i] - mx) / z : sigmoid(a[i]);
      for (int64_t k = 0; k < dh; k++) {
        double acc = 0;
        for (int64_t i = 0; i < S; i++) acc += a[i] * v[i][n * d + h * dh + k];
        out[n * d + h * dh + k] = acc;
      }
    }
  }
}

ops::DepthMix depth_mix(int64_t d, int64_t H, bool softmax, bool key_norm) {
  ops::DepthMix m;
  m.d = d;
  m.H = H;
  m.softmax = softmax;
  m.key_norm = key_norm;
  m.eps = 1e-5f;
  return m;
}

// Sources on a backend with their inverse RMS (as the model computes it; the gradient
// accumulators dv from dx, or none).
struct BackendSources {
  std::vector<std::shared_ptr<DevBuf<float>>> rstd;
  std::vector<ops::DepthSource> src;
};
BackendSources backend_sources(Backend& be, const Ptrs& v, int64_t N, const ops::DepthMix& m,
                               const Ptrs* dv) {
  BackendSources s;
  for (size_t i = 0; i < v.size(); i++) {
    s.rstd.push_back(scratch(be, N * m.H));
    be.depth_rstd(s.rstd[i]->data(), v[i], N, m.d, m.H, m.eps);
    s.src.push_back({v[i], s.rstd[i]->data(), dv ? (*dv)[i] : nullptr});
  }
  return s;
}

// The AttnRes depth mix over S sources (the key norm's inverse RMS from depth_rstd, as the
// model computes it); q_ld = d: a query per token (dynamic queries).
OpCase depth_mix_case(int64_t N, int64_t d, int64_t S, int64_t H, bool softmax, bool key_norm,
                      bool per_token_query) {
  const ops::DepthMix m = depth_mix(d, H, softmax, key_norm);
  const int64_t nq = per_token_query ? N * d : d, q_ld = per_token_query ? d : 0;
  OpCase c = make_case("depth_mix_N" + std::to_string(N) + "_d" + std::to_string(d) + "_S" +
                           std::to_string(S) + "_H" + std::to_string(H) +
                           (softmax ? "_softmax" : "_sigmoid") + (key_norm ? "_rms" : "_nonorm") +
                           (per_token_query ? "_dynamic" : ""),
                       {}, N * d);
  for (int64_t i = 0; i < S; i++) c.in.push_back({"v" + std::to_string(i), N * d, 0.5 + 0.4 * i});
  c.in.push_back({"qg", nq, 0.6});
  c.ref = [=](const HostIn& x, double* out) {
    ref_depth_mix(HostIn(x.begin(), x.begin() + S), x[S], q_ld, N, m, out);
  };
  c.fwd = [=](Backend& be, const Ptrs& x, float* out) {
    const BackendSources s = backend_sources(be, Ptrs(x.begin(), x.begin() + S), N, m, nullptr);
    auto lse = scratch(be, N * H);
    be.depth_mix_forward(out, lse->data(), s.src.data(), S, x[S], q_ld, m, N);
    be.synchronize();
  };
  c.bwd = [=](Backend& be, const Ptrs& x, const float* dout, const Ptrs& dx) {
    const Ptrs dv(dx.begin(), dx.begin() + S);
    const BackendSources s = backend_sources(be, Ptrs(x.begin(), x.begin() + S), N, m, &dv);
    auto out = scratch(be, N * d), lse = scratch(be, N * H);
    be.depth_mix_forward(out->data(), lse->data(), s.src.data(), S, x[S], q_ld, m, N);
    be.depth_mix_backward(dx[S], dout, out->data(), lse->data(), s.src.data(), S, x[S], q_ld, m, N);
    be.synchronize();
  };
  return c;
}

// Two-phase Block AttnRes (SPEC 4): phase 1 mixes the S completed blocks with each of K static
// queries at once, phase 2 merges the current block's partial sum p into each; out = the K
// mixes (K,N,d), each equal to the one-pass mix over the S blocks and p. Forward only (training
// differentiates the one-pass mix: depth_mix_backward).
OpCase depth_two_phase_case(int64_t N, int64_t d, int64_t S, int64_t K, int64_t H) {
  const ops::DepthMix m = depth_mix(d, H, true, true);
  OpCase c = make_case("depth_two_phase_N" + std::to_string(N) + "_d" + std::to_string(d) + "_S" +
                           std::to_string(S) + "_K" + std::to_string(K) + "_H" + std::to_string(H),
                       {}, K * N * d);
  for (int64_t i = 0; i <= S; i++) {
    c.in.push_back({i < S ? "v" + std::to_string(i) : "p", N * d, 0.5 + 0.3 * i});
  }
  c.in.push_back({"q", K * d, 0.6});
  c.ref = [=](const HostIn& x, double* out) {
    for (int64_t k = 0; k < K; k++) {
      ref_depth_mix(HostIn(x.begin(), x.begin() + S + 1), x[S + 1] + k * d, 0, N, m,
                    out + k * N * d);
    }
  };
  c.fwd = [=](Backend& be, const Ptrs& x, float* out) {
    const BackendSources s = backend_sources(be, Ptrs(x.begin(), x.begin() + S + 1), N, m, nullptr);
    std::vector<std::shared_ptr<DevBuf<float>>> keep;
    std::vector<float*> o, lse;
    std::vector<const float*> q;
    for (int64_t k = 0; k < K; k++) {
      keep.push_back(scratch(be, N * d));
      o.push_back(keep.back()->data());
      keep.push_back(scratch(be, N * H));
      lse.push_back(keep.back()->data());
      q.push_back(x[S + 1] + k * d);
    }
    be.depth_mix_phase1(o.data(), lse.data(), s.src.data(), S, q.data(), K, m, N);
    auto lse2 = scratch(be, N * H);
    for (int64_t k = 0; k < K; k++) {
      be.depth_mix_phase2(out + k * N * d, lse2->data(), o[k], lse[k], s.src[S], q[k], m, N);
    }
    be.synchronize();
  };
  return c;
}

// Full AttnRes's by-source backward (static queries): K readers each mix the same S sources
// (out: the K mixes, (K,N,d)); the backward takes one source at a time, its gradient from all
// K readers at once (WRITTEN), and adds each reader's query gradient from that source to
// dq + k d. Over all S sources that is the whole gradient.
// grouped: all S sources in one depth_sources_backward (one pass over the readers' dx).
OpCase depth_by_source_case(int64_t N, int64_t d, int64_t S, int64_t K, int64_t H, bool softmax,
                            bool key_norm, bool grouped = false) {
  const ops::DepthMix m = depth_mix(d, H, softmax, key_norm);
  OpCase c = make_case("depth_by_source_N" + std::to_string(N) + "_d" + std::to_string(d) + "_S" +
                           std::to_string(S) + "_K" + std::to_string(K) + "_H" + std::to_string(H) +
                           (softmax ? "_softmax" : "_sigmoid") + (key_norm ? "_rms" : "_nonorm") +
                           (grouped ? "_grouped" : ""),
                       {}, K * N * d);
  for (int64_t i = 0; i < S; i++) {
    c.in.push_back({"v" + std::to_string(i), N * d, 0.5 + 0.3 * i, 0.0, true, /*written=*/true});
  }
  c.in.push_back({"q", K * d, 0.6});
  c.ref = [=](const HostIn& x, double* out) {
    for (int64_t k = 0; k < K; k++) {
      ref_depth_mix(HostIn(x.begin(), x.begin() + S), x[S] + k * d, 0, N, m, out + k * N * d);
    }
  };
  // Each reader's mix and lse, from the same sources.
  auto mixes = [=](Backend& be, const Ptrs& x, const BackendSources& s, float* out,
                   std::vector<std::shared_ptr<DevBuf<float>>>& lse) {
    for (int64_t k = 0; k < K; k++) {
      lse.push_back(scratch(be, N * H));
      be.depth_mix_forward(out + k * N * d, lse.back()->data(), s.src.data(), S, x[S] + k * d, 0, m,
                           N);
    }
  };
  c.fwd = [=](Backend& be, const Ptrs& x, float* out) {
    const BackendSources s = backend_sources(be, Ptrs(x.begin(), x.begin() + S), N, m, nullptr);
    std::vector<std::shared_ptr<DevBuf<float>>> lse;
    mixes(be, x, s, out, lse);
    be.synchronize();
  };
  c.bwd = [=](Backend& be, const Ptrs& x, const float* dout, const Ptrs& dx) {
    const BackendSources s = backend_sources(be, Ptrs(x.begin(), x.begin() + S), N, m, nullptr);
    auto out = scratch(be, K * N * d);
    std::vector<std::shared_ptr<DevBuf<float>>> lse, D;
    mixes(be, x, s, out->data(), lse);
    std::vector<ops::DepthReader> rd;
    for (int64_t k = 0; k < K; k++) {
      D.push_back(scratch(be, N * H));
      be.depth_dx_dot(D.back()->data(), dout + k * N * d, out->data() + k * N * d, m, N);
      rd.push_back({dout + k * N * d, lse[k]->data(), D.back()->data(), x[S] + k * d, 0});
    }
    if (grouped) {
      be.depth_sources_backward(dx.data(), s.src.data(), S, rd.data(), K, dx[S], m, N);
    } else {
      for (int64_t i = 0; i < S; i++) {
        be.depth_source_backward(dx[i], s.src[i], rd.data(), K, dx[S], m, N);
      }
    }
    be.synchronize();
  };
  return c;
}

// The static and DenseFormer residuals' weighted sum; the weights' gradient is WRITTEN.
OpCase scalar_mix_case(int64_t S, int64_t n) {
  OpCase c = make_case("scalar_mix_S" + std::to_string(S) + "_n" + std::to_string(n), {}, n);
  for (int64_t i = 0; i < S; i++) c.in.push_back({"src" + std::to_string(i), n});
  c.in.push_back({"w", S, 0.5, 0.0, true, /*written=*/true});
  c.ref = [=](const HostIn& x, double* out) {
    for (int64_t k = 0; k < n; k++) {
      double s = 0;
      for (int64_t i = 0; i < S; i++) s += x[S][i] * x[i][k];
      out[k] = s;
    }
  };
  c.fwd = [=](Backend& be, const Ptrs& x, float* out) {
    const std::vector<const float*> src(x.begin(), x.begin() + S);
    be.scalar_mix_forward(out, src.data(), x[S], S, n);
  };
  c.bwd = [=](Backend& be, const Ptrs& x, const float* dout, const Ptrs& dx) {
    const std::vector<const float*> src(x.begin(), x.begin() + S);
    const std::vector<float*> dsrc(dx.begin(), dx.begin() + S);
    be.scalar_mix_backward(dsrc.data(), dx[S], dout, src.data(), x[S], S, n);
  };
  c.fwd_tol = 1e-6;
  return c;
}

OpCase softmax_small_case(int64_t S) {
  OpCase c = make_case("softmax_small_S" + std::to_string(S), {{"z", S, 2.0}}, S);
  c.ref = [=](const HostIn& x, double* out) {
    double mx = x[0][0], z = 0;
    for (int64_t i = 1; i < S; i++) mx = std::max(mx, x[0][i]);
    for (int64_t i = 0; i < S; i++) z += std::exp(x[0][i] - mx);
    for (int64_t i = 0; i < S; i++) out[i] = std::exp(x[0][i] - mx) / z;
  };
  c.fwd = [=](Backend& be, const Ptrs& x, float* out) { be.softmax_small(out, x[0], S); };
  c.bwd = [=](Backend& be, const Ptrs& x, const float* dout, const Ptrs& dx) {
    auto a = scratch(be, S);
    be.softmax_small(a->data(), x[0], S);
    be.softmax_small_backward(dx[0], a->data(), dout, S);
    be.synchronize();
  };
  return c;
}

const std::vector<OpCase>& cases() {
  static const std::vector<OpCase> table = [] {
    std::vector<OpCase> t;
    t.push_back(embedding_case(9, 6, 7));
    t.push_back(rmsnorm_case(6, 16));
    t.push_back(rmsnorm_case(5, 131));
    t.push_back(matmul_case(5, 7, 3));
    t.push_back(matmul_case(33, 64, 48));
    t.push_back(rope_case(2, 5, 3, 8, 0));
    t.push_back(rope_case(1, 4, 2, 16, 6));
    t.push_back(attention_case(2, 5, 4, 2, 8));
    t.push_back(attention_case(1, 17, 2, 2, 16));
    t.push_back(swiglu_case(6, 10));
    t.push_back(cross_entropy_case(6, 13));
    t.push_back(depth_mix_case(9, 16, 4, 1, true, true, false));
    t.push_back(depth_mix_case(9, 16, 3, 2, true, true, false));
    t.push_back(depth_mix_case(7, 16, 4, 1, false, false, false));
    t.push_back(depth_mix_case(7, 16, 3, 4, true, false, false));
    t.push_back(depth_mix_case(7, 16, 3, 1, true, true, true));
    t.push_back(depth_two_phase_case(9, 16, 3, 4, 1));
    t.push_back(depth_two_phase_case(7, 16, 2, 3, 2));
    // Wide heads: the kernels' 64-float register blocks, then 16-float ones, then single floats
    // (dh 88 = 64 + 16 + 8); six queries go in groups of four and two.
    t.push_back(depth_mix_case(5, 88, 4, 1, true, true, false));
    t.push_back(depth_mix_case(5, 96, 3, 2, true, true, false));
    t.push_back(depth_mix_case(5, 128, 4, 1, false, false, false));
    t.push_back(depth_two_phase_case(5, 88, 3, 6, 1));
    t.push_back(depth_two_phase_case(5, 128, 3, 5, 2));
    t.push_back(depth_by_source_case(5, 88, 3, 3, 1, true, true, /*grouped=*/true));
    // (heads of 3 and 8 x 16 floats: the backward's register path, update_tile)
    t.push_back(depth_by_source_case(5, 96, 3, 3, 2, true, true, /*grouped=*/true));
    t.push_back(depth_by_source_case(5, 128, 2, 2, 1, false, false));
    t.push_back(depth_by_source_case(9, 16, 4, 3, 1, true, true));
    t.push_back(depth_by_source_case(7, 16, 3, 2, 2, true, true));
    t.push_back(depth_by_source_case(7, 16, 3, 2, 1, false, false));
    t.push_back(depth_by_source_case(9, 16, 4, 3, 1, true, true, /*grouped=*/true));
    t.push_back(depth_by_source_case(7, 16, 3, 2, 2, true, true, /*grouped=*/true));
    t.push_back(depth_by_source_case(7, 16, 3, 2, 1, false, false, /*grouped=*/true));
    t.push_back(scalar_mix_case(5, 37));
    t.push_back(softmax_small_case(7));
    return t;
  }();
  return table;
}

constexpr int64_t kSamples = 48;  // finite-difference elements per input

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// sum(R * ref(x)) in double.
double ref_loss(const OpCase& c, const std::vector<std::vector<double>>& x,
                const std::vector<float>& R) {
  HostIn p;
  for (const auto& v : x) p.push_back(v.data());
  std::vector<double> out(static_cast<size_t>(c.n_out));
  c.ref(p, out.data());
  double s = 0;
  for (int64_t k = 0; k < c.n_out; k++) s += R[k] * out[k];
  return s;
}

class OpTable : public ::testing::TestWithParam<std::tuple<std::string, size_t>> {
 protected:
  void SetUp() override {
    try {
      be_ = make_backend(std::get<0>(GetParam()));
    } catch (const Error& e) {
      GTEST_SKIP() << "no " << std::get<0>(GetParam()) << " test: " << e.what();
    }
  }
  std::shared_ptr<Backend> be_;
};

TEST_P(OpTable, ForwardBackwardAndAccumulation) {
  const OpCase& c = cases()[std::get<1>(GetParam())];
  Backend& be = *be_;
  // inputs, on the host (float, then double for the reference) and on the backend
  std::vector<std::vector<float>> xh;
  std::vector<std::shared_ptr<DevBuf<float>>> xd;
  Ptrs xp;
  for (size_t i = 0; i < c.in.size(); i++) {
    auto v = randn(c.in[i].n, 1000 + 17 * i, c.in[i].scale);
    for (float& f : v) f += static_cast<float>(c.in[i].offset);
    xh.push_back(v);
    xd.push_back(scratch(be, c.in[i].n));
    xd.back()->upload(v.data(), v.size());
    xp.push_back(xd.back()->data());
  }
  std::vector<std::vector<double>> x64;
  for (const auto& v : xh) x64.push_back(to_double(v));

  // 1. forward against the reference
  std::vector<double> want(static_cast<size_t>(c.n_out));
  {
    HostIn p;
    for (const auto& v : x64) p.push_back(v.data());
    c.ref(p, want.data());
  }
  auto out = scratch(be, c.n_out);
  c.fwd(be, xp, out->data());
  const std::vector<float> got = out->download();
  const std::vector<float> wantf(want.begin(), want.end());
  EXPECT_LT(rel_diff(got.data(), wantf.data(), c.n_out, 1e-30), c.fwd_tol) << "forward";
  if (!c.bwd) return;

  // 2./3. backward on top of random gradient buffers, against finite differences
  const std::vector<float> R = randn(c.n_out, 77);
  auto dout = scratch(be, c.n_out);
  dout->upload(R.data(), R.size());
  std::vector<std::vector<float>> base;
  std::vector<std::shared_ptr<DevBuf<float>>> gd;
  Ptrs gp;
  for (size_t i = 0; i < c.in.size(); i++) {
    base.push_back(randn(c.in[i].n, 2000 + i, 0.1));
    gd.push_back(scratch(be, c.in[i].n));
    gd.back()->upload(base[i].data(), base[i].size());
    gp.push_back(c.in[i].grad ? gd.back()->data() : nullptr);
  }
  c.bwd(be, xp, dout->data(), gp);
  for (size_t i = 0; i < c.in.size(); i++) {
    if (!c.in[i].grad) continue;
    SCOPED_TRACE("gradient of " + c.in[i].name);
    std::vector<float> g = gd[i]->download();
    if (!c.in[i].written) {
      for (int64_t k = 0; k < c.in[i].n; k++) g[k] -= base[i][k];
    }
    const int64_t n = c.in[i].n, step = std::max<int64_t>(1, n / kSamples);
    std::vector<float> fd, an;
    for (int64_t k = 0; k < n; k += step) {
      auto xs = x64;
      const double h = 1e-4 * std::max(1.0, std::abs(xs[i][k]));
      xs[i][k] += h;
      const double lp = ref_loss(c, xs, R);
      xs[i][k] -= 2 * h;
      const double lm = ref_loss(c, xs, R);
      fd.push_back(static_cast<float>((lp - lm) / (2 * h)));
      an.push_back(g[k]);
    }
    EXPECT_LT(rel_diff(an.data(), fd.data(), static_cast<int64_t>(fd.size()), 1e-6), c.bwd_tol);
  }
}

std::vector<size_t> case_indices() {
  std::vector<size_t> r(cases().size());
  for (size_t i = 0; i < r.size(); i++) r[i] = i;
  return r;
}

INSTANTIATE_TEST_SUITE_P(Ops, OpTable,
                         ::testing::Combine(::testing::Values("cpu", "cuda-host", "cuda"),
                                            ::testing::ValuesIn(case_indices())),
                         [](const auto& param_info) {
                           std::string n = std::get<0>(param_info.param) + "_" +
                                           cases()[std::get<1>(param_info.param)].name;
                           for (auto& ch : n) ch = std::isalnum(ch) ? ch : '_';
                           return n;
                         });

}  // namespace
