// GPU timings for tools/device_check.sh (CUDA builds: -DATTNRES_CUDA=ON), as short tables: cuBLAS
// fp32 and bf16 GEMM throughput, the AttnRes depth-mix kernels at a training shape, and whole
// training steps (forward, backward, AdamW) of a GPT-2-small-sized model with each residual mode
// and fp32 or bf16 GEMMs, measured side by side in one run, then where each step's time goes by op
// family. Prints the reason and exits 0 where no GPU is present.
// Usage: cuda_bench [--dry-run]
//   --dry-run: tiny shapes on the cuda-host backend (the CUDA kernels emulated on the CPU): checks
//   the benchmark itself on any machine (a test runs it); its timings mean nothing.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "attnres/backend.hpp"
#include "attnres/cuda.hpp"
#include "attnres/model.hpp"
#include "attnres/optim.hpp"
#include "attnres/train.hpp"
#include "backend/backend.hpp"
#include "core/profile.hpp"
#include "core/rng.hpp"
#include "train/device_step.hpp"
#ifdef ATTNRES_WITH_CUDA
#include "cuda/device.hpp"
#endif

using namespace attnres;

namespace {

// Median of `reps` timed runs after one warm-up, in milliseconds.
double time_ms(Backend& be, const std::function<void()>& f, int reps = 10) {
  f();
  be.synchronize();
  std::vector<double> t;
  for (int i = 0; i < reps; i++) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    be.synchronize();
    t.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// The same training step driven as `attnres train` does on a device (train/device_step.hpp):
// uncaptured, and replayed from CUDA graphs (each warmed up and captured before the timing).
struct StepTimes {
  double device_ms = 0, graph_ms = 0;
};
StepTimes time_device_steps(Backend& be, Model& model, AdamW& opt, const std::vector<int32_t>& tok,
                            const std::vector<int32_t>& tgt, int64_t B, int64_t T) {
  StepTimes r;
  for (const bool graphs : {false, true}) {
    DeviceStep ds(model, opt, 1.0, 1.0f, graphs);
    auto step = [&] {
      ds.begin();
      ds.micro(tok.data(), tgt.data(), B, T);
      ds.finish(1e-4);
    };
    step();  // (time_ms warms up once more: the graphs are captured then)
    (graphs ? r.graph_ms : r.device_ms) = time_ms(be, step, 5);
    if (graphs && !ds.off_reason().empty()) {
      std::printf("(CUDA graphs turned off: %s)\n", ds.off_reason().c_str());
    }
  }
  return r;
}

DevBuf<float> buffer(Backend& be, int64_t n) {
  DevBuf<float> b;
  b.on(&be).resize(static_cast<size_t>(n));
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  const bool dry = argc > 1 && std::strcmp(argv[1], "--dry-run") == 0;
  std::string why;
  if (!dry && cuda::device_count(&why) == 0) {
    std::printf("cuda_bench: %s\n", why.c_str());
    return 0;
  }
  // (every op timed when the profiler is on: the one profiled step per mode)
  auto bep = make_profiled_backend(make_backend(dry ? "cuda-host" : "cuda"));
  Backend& be = *bep;
  std::printf("device: %s\n", dry ? "cuda-host (dry run)" : cuda::describe_device().c_str());
  std::printf("| what | shape | ms | rate |\n|---|---|---|---|\n");
  {
    const int64_t n = dry ? 128 : 4096;
    auto a = buffer(be, n * n), b = buffer(be, n * n), c = buffer(be, n * n);
    const double ms =
        time_ms(be, [&] { be.matmul_forward(c.data(), a.data(), b.data(), n, n, n); });
    std::printf("| sgemm (cuBLAS, fp32) | %lld^3 | %.3f | %.1f TFLOP/s |\n",
                static_cast<long long>(n), ms, 2.0 * n * n * n / ms / 1e9);
  }
#ifdef ATTNRES_WITH_CUDA
  if (!dry) {
    const int64_t n = 8192;
    cuda::DeviceVec<uint16_t> a(n * n), b(n * n);
    cuda::DeviceVec<float> c(n * n);
    const double ms =
        time_ms(be, [&] { cuda::dev::matmul_forward_bf16(c.data(), a.data(), b.data(), n, n, n); });
    std::printf("| bf16 GEMM (cuBLAS GemmEx, fp32 accumulate) | %lld^3 | %.3f | %.1f TFLOP/s |\n",
                static_cast<long long>(n), ms, 2.0 * n * n * n / ms / 1e9);
  }
#endif
  // Causal attention at the training steps' shape below and at longer sequences of as many
  // tokens, three ways (ATTNRES_FLASH_ATTENTION picks flash kernels or batched GEMMs for bf16).
  // FLOPs as FlashAttention reports them: the causal half of QK^T and PV forward (2 B H T^2 hd),
  // 2.5 times that backward.
  for (const auto& [B, T] :
       dry ? std::vector<std::pair<int64_t, int64_t>>{{2, 32}}
           : std::vector<std::pair<int64_t, int64_t>>{{8, 512}, {2, 2048}, {1, 4096}}) {
    const ops::AttnShape s{B, T, dry ? 4 : 12, dry ? 4 : 12, 64};
    const int64_t N = s.B * s.T, HD = s.H * s.hd;
    const double flop = 2.0 * s.B * s.H * s.T * s.T * s.hd;
    const char* old = std::getenv("ATTNRES_FLASH_ATTENTION");
    const std::string keep = old ? old : "";
    for (const char* way : {"fp32", "bf16 0", "bf16 1"}) {
      const std::string w = way;
      setenv("ATTNRES_FLASH_ATTENTION", w.size() > 4 ? w.substr(5).c_str() : "0", 1);
      auto b = make_backend(dry ? "cuda-host" : "cuda");
      b->set_matmul_precision(parse_precision(w.substr(0, 4)));
      const int64_t st = b->attention_state_floats(s);
      const bool flash = st == s.B * s.H * s.T;
      auto qkv = buffer(*b, N * s.ld()), out = buffer(*b, N * HD), att = buffer(*b, st),
           scr = buffer(*b, st), dout = buffer(*b, N * HD), dqkv = buffer(*b, N * s.ld());
      auto fwd = [&] { b->attention_forward(out.data(), att.data(), qkv.data(), s); };
      const double f = time_ms(*b, fwd);
      const double fb = time_ms(*b, [&] {
        fwd();
        b->attention_backward(dqkv.data(), scr.data(), dout.data(), qkv.data(), out.data(),
                              att.data(), s);
      });
      std::printf(
          "| attention fwd / fwd+bwd, %s %s | B %lld, T %lld, H %lld, hd %lld | %.3f / "
          "%.3f | %.1f / %.1f TFLOP/s (causal) |\n",
          w.substr(0, 4).c_str(), flash ? "flash kernels" : "batched GEMMs",
          static_cast<long long>(s.B), static_cast<long long>(s.T), static_cast<long long>(s.H),
          static_cast<long long>(s.hd), f, fb, flop / f / 1e9, 3.5 * flop / fb / 1e9);
    }
    if (old) {
      setenv("ATTNRES_FLASH_ATTENTION", keep.c_str(), 1);
    } else {
      unsetenv("ATTNRES_FLASH_ATTENTION");
    }
  }
  {
    // 8 sequences of 1024 tokens, d 1024, 9 sources
    const int64_t N = dry ? 64 : 8192, d = dry ? 64 : 1024, S = 9;
    std::vector<DevBuf<float>> v, r, dv;
    std::vector<ops::DepthSource> src;
    for (int64_t i = 0; i < S; i++) {
      v.push_back(buffer(be, N * d));
      r.push_back(buffer(be, N));
      dv.push_back(buffer(be, N * d));
    }
    for (int64_t i = 0; i < S; i++) src.push_back({v[i].data(), r[i].data(), dv[i].data()});
    auto q = buffer(be, d), dq = buffer(be, d), x = buffer(be, N * d), lse = buffer(be, N),
         dx = buffer(be, N * d);
    ops::DepthMix m;
    m.d = d;
    const double bytes_f = 4.0 * (S + 1) * N * d, bytes_b = 4.0 * (3 * S + 2) * N * d;
    const double f = time_ms(
        be, [&] { be.depth_mix_forward(x.data(), lse.data(), src.data(), S, q.data(), 0, m, N); });
    const double bw = time_ms(be, [&] {
      be.depth_mix_backward(dq.data(), dx.data(), x.data(), lse.data(), src.data(), S, q.data(), 0,
                            m, N);
    });
    std::printf("| depth mix forward | N %lld, d %lld, %lld sources | %.3f | %.0f GB/s |\n",
                static_cast<long long>(N), static_cast<long long>(d), static_cast<long long>(S), f,
                bytes_f / f / 1e6);
    std::printf("| depth mix backward | same | %.3f | %.0f GB/s |\n", bw, bytes_b / bw / 1e6);
    // As tools/depth_mix_torch.py times PyTorch: the sources' key-norm RMS, forward, backward.
    const double both = time_ms(be, [&] {
      for (int64_t i = 0; i < S; i++) be.depth_rstd(r[i].data(), v[i].data(), N, d, 1, 1e-5f);
      be.depth_mix_forward(x.data(), lse.data(), src.data(), S, q.data(), 0, m, N);
      be.depth_mix_backward(dq.data(), dx.data(), x.data(), lse.data(), src.data(), S, q.data(), 0,
                            m, N);
    });
    std::printf(
        "| depth mix fwd+bwd with the sources' RMS (cf. tools/depth_mix_torch.py) | same "
        "| %.3f | %.0f GB/s at the minimum traffic |\n",
        both, 4.0 * (2 * S + 1) * N * d / both / 1e6);
    // The same with bf16 copies of the sources (--precision bf16 stores them for the depth mix).
    std::vector<DevBuf<uint16_t>> vb(S);
    std::vector<ops::DepthSource> srcb = src;
    for (int64_t i = 0; i < S; i++) {
      vb[i].on(&be).resize(static_cast<size_t>(N * d));
      be.to_bf16(vb[i].data(), v[i].data(), N * d);
      srcb[i].vb = vb[i].data();
    }
    const double fh = time_ms(
        be, [&] { be.depth_mix_forward(x.data(), lse.data(), srcb.data(), S, q.data(), 0, m, N); });
    const double bh = time_ms(be, [&] {
      be.depth_mix_backward(dq.data(), dx.data(), x.data(), lse.data(), srcb.data(), S, q.data(), 0,
                            m, N);
    });
    std::printf(
        "| depth mix forward, bf16 sources | same | %.3f | %.2fx the fp32 sources' time |\n", fh,
        fh / f);
    std::printf("| depth mix backward, bf16 sources | same | %.3f | %.2fx |\n", bh, bh / bw);
    // Full AttnRes's by-source backward: one source's gradient from S readers.
    std::vector<DevBuf<float>> D;
    std::vector<ops::DepthReader> rd;
    for (int64_t k = 0; k < S; k++) D.push_back(buffer(be, N));
    for (int64_t k = 0; k < S; k++) rd.push_back({dx.data(), lse.data(), D[k].data(), q.data(), 0});
    auto dqs = buffer(be, S * d);
    const double sb = time_ms(be, [&] {
      be.depth_source_backward(dv[0].data(), src[0], rd.data(), S, dqs.data(), m, N);
    });
    std::printf(
        "| by-source backward (Full AttnRes): one source, %lld readers | same | %.3f | "
        "%.0f GB/s |\n",
        static_cast<long long>(S), sb, 4.0 * (S + 2) * N * d / sb / 1e6);
  }
  // Whole fp32 training steps: GPT-2 small shapes (124M parameters with its 50257-token
  // vocabulary), B x T tokens per step.
  ModelConfig cfg;
  cfg.n_layer = dry ? 2 : 12;
  cfg.d_model = dry ? 64 : 768;
  cfg.n_head = dry ? 4 : 12;
  cfg.ffn_hidden = dry ? 128 : 2048;
  cfg.vocab_size = dry ? 300 : 50257;
  const int64_t B = dry ? 2 : 8, T = dry ? 32 : 512;
  cfg.max_seq_len = T;
  std::vector<int32_t> tok(B * T), tgt(B * T);
  Rng rng(1);
  for (size_t i = 0; i < tok.size(); i++) {
    tok[i] = static_cast<int32_t>(rng.next_u64() % cfg.vocab_size);
    tgt[i] = static_cast<int32_t>(rng.next_u64() % cfg.vocab_size);
  }
  std::vector<std::string> profiles;  // one row per (precision, mode): ms per op family
  for (const char* precision : {"fp32", "bf16"}) {
    double base_ms = 0;
    for (const char* mode : {"prenorm", "block", "full"}) {
      cfg.residual.mode = parse_residual_mode(mode);
      cfg.residual.block_size = 4;
      Model model(cfg, bep);
      be.set_matmul_precision(parse_precision(precision));
      model.init_weights(1);
      AdamW opt(model.layout(), AdamWConfig{}, &be);
      double loss = 0;
      const double ms = time_ms(
          be,
          [&] {
            model.zero_grad();
            loss = model.forward(tok.data(), tgt.data(), B, T);
            model.backward();
            opt.step(model.params(), model.grads(), 1e-4);
          },
          5);
      if (base_ms == 0) base_ms = ms;
      const double tflops = train_flops_per_token(model.config(), T) * B * T / ms / 1e9;
      const StepTimes st = time_device_steps(be, model, opt, tok, tgt, B, T);
      std::printf(
          "| train step %s GEMMs, %s | %lld params, L %lld, d %lld, %lldx%lld tokens | %.1f | %.0f "
          "tok/s, %.1f TFLOP/s, %.3fx baseline, loss %.3f; device step %.1f ms, CUDA graphs "
          "%.1f ms |\n",
          precision, mode, static_cast<long long>(model.num_params()),
          static_cast<long long>(cfg.n_layer), static_cast<long long>(cfg.d_model),
          static_cast<long long>(B), static_cast<long long>(T), ms, B * T / ms * 1e3, tflops,
          ms / base_ms, loss, st.device_ms, st.graph_ms);
      // One more step with the profiler, each op family's scope waiting for the device.
      prof::set_synchronizer([](void* b) { static_cast<Backend*>(b)->synchronize(); }, &be);
      prof::reset();
      prof::enable(true);
      model.zero_grad();
      model.forward(tok.data(), tgt.data(), B, T);
      model.backward();
      {
        const prof::Region pr(prof::kOptimizer);
        opt.step(model.params(), model.grads(), 1e-4);
      }
      prof::enable(false);
      prof::set_synchronizer(nullptr, nullptr);
      std::string row = std::string("| ") + precision + " " + mode + " |";
      for (int op = 0; op < prof::kOpCount; op++) {
        char cell[48];
        std::snprintf(cell, sizeof cell, " %.2f / %.2f |", 1e3 * prof::seconds(op, prof::kForward),
                      1e3 * prof::seconds(op, prof::kBackward));
        row += cell;
      }
      profiles.push_back(row);
    }
  }
  // A small model whose kernels are short: where launching hundreds of them per step costs
  // most, and CUDA graphs should pay.
  {
    ModelConfig sc;
    sc.n_layer = dry ? 2 : 4;
    sc.d_model = dry ? 32 : 256;
    sc.n_head = 4;
    sc.ffn_hidden = dry ? 64 : 688;
    sc.vocab_size = dry ? 300 : 4096;
    const int64_t sb = dry ? 2 : 4, stt = dry ? 16 : 128;
    sc.max_seq_len = stt;
    std::vector<int32_t> stok(sb * stt), stgt(sb * stt);
    for (size_t i = 0; i < stok.size(); i++) {
      stok[i] = static_cast<int32_t>(rng.next_u64() % sc.vocab_size);
      stgt[i] = static_cast<int32_t>(rng.next_u64() % sc.vocab_size);
    }
    for (const char* mode : {"prenorm", "block", "full"}) {
      sc.residual.mode = parse_residual_mode(mode);
      sc.residual.block_size = 2;
      Model model(sc, bep);
      be.set_matmul_precision(MatmulPrecision::fp32);
      model.init_weights(1);
      AdamW opt(model.layout(), AdamWConfig{}, &be);
      const double ms = time_ms(
          be,
          [&] {
            model.zero_grad();
            model.forward(stok.data(), stgt.data(), sb, stt);
            model.backward();
            opt.step(model.params(), model.grads(), 1e-4);
          },
          10);
      const StepTimes st = time_device_steps(be, model, opt, stok, stgt, sb, stt);
      std::printf(
          "| small train step fp32, %s | %lld params, L %lld, d %lld, %lldx%lld tokens | "
          "%.2f | device step %.2f ms, CUDA graphs %.2f ms (%.2fx) |\n",
          mode, static_cast<long long>(model.num_params()), static_cast<long long>(sc.n_layer),
          static_cast<long long>(sc.d_model), static_cast<long long>(sb),
          static_cast<long long>(stt), ms, st.device_ms, st.graph_ms, st.device_ms / st.graph_ms);
    }
  }
  std::printf(
      "\nms per training step by op family, forward / backward (one profiled step, the "
      "device synchronised around each op):\n| GEMMs, mode |");
  for (int op = 0; op < prof::kOpCount; op++) std::printf(" %s |", prof::op_name(op));
  std::printf("\n|---|");
  for (int op = 0; op < prof::kOpCount; op++) std::printf("---|");
  std::printf("\n");
  for (const std::string& r : profiles) std::printf("%s\n", r.c_str());
  return 0;
}
