// `attnres bench`: training and inference throughput per residual mode, measured side by side in
// one invocation, against the sgemm ceiling measured in the same run. Each mode runs in its own
// child process so that its peak memory (max RSS) is its own.
#include <sys/prctl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <omp.h>
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "attnres/checkpoint.hpp"
#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/generate.hpp"
#include "attnres/model.hpp"
#include "attnres/optim.hpp"
#include "attnres/safetensors.hpp"
#include "attnres/train.hpp"
#include "backend/backend.hpp"
#include "cli/commands.hpp"
#include "cli/device_options.hpp"
#include "cli/progress.hpp"
#include "core/blas.hpp"
#include "core/profile.hpp"
#include "core/rng.hpp"
#include "train/device_step.hpp"

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace attnres::cli {

namespace {

struct BenchArgs {
  int64_t d_model = 512, n_layer = 8, n_head = 8, seq_len = 512, batch = 4, vocab = 8192;
  std::string modes = "prenorm,full,block";
  int64_t block_size = 4;
  bool two_phase = true;  // AttnRes's two-phase computation (SPEC 4): off to measure what it gains
  int64_t steps = 5, warmup = 2, decode_tokens = 64;
  int64_t repeats = 1;  // rounds over all modes (interleaved); per mode the median-time round
  std::string json_out;
  std::string child_mode;     // internal: run one mode and print its JSON
  std::string torch_pythons;  // comma-separated interpreters for tools/bench_torch.py
  std::string weights_out;    // internal: child writes weights + batch here (for PyTorch)
  DeviceArgs dev;
  bool cuda_graphs = false;  // on a device: time the steps replayed from CUDA graphs
};

double secs(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Milliseconds per token of the timed single-token steps; null when none was timed
// (--decode-tokens 0), never a made-up 0.
json ms_per_token(const std::vector<double>& times) {
  return times.empty() ? json(nullptr) : json(1e3 * median(times));
}

// A figure that may be null, printed as "n/a".
std::string figure(const json& v, int width, int decimals) {
  char b[32];
  if (v.is_number()) {
    std::snprintf(b, sizeof b, "%*.*f", width, decimals, v.get<double>());
  } else {
    std::snprintf(b, sizeof b, "%*s", width, "n/a");
  }
  return b;
}

ModelConfig bench_config(const BenchArgs& a, const std::string& mode) {
  ModelConfig c;
  c.n_layer = a.n_layer;
  c.d_model = a.d_model;
  c.n_head = a.n_head;
  c.vocab_size = a.vocab;
  c.max_seq_len = a.seq_len + a.decode_tokens;
  c.tied = false;
  c.residual.mode = parse_residual_mode(mode);
  c.residual.block_size = a.block_size;
  c.residual.two_phase = a.two_phase;
  c.resolve();
  c.validate();
  return c;
}

// Best-of-5 GFLOP/s of a square sgemm: the ceiling the model's FLOP/s is measured against.
double sgemm_gflops(int64_t n) {
  std::vector<float> A(n * n, 0.5f), B(n * n, 0.25f), C(n * n);
  double best = 0;
  for (int r = 0; r < 6; r++) {
    const auto t0 = Clock::now();
    sgemm(false, false, n, n, n, 1.0f, A.data(), n, B.data(), n, 0.0f, C.data(), n);
    const double s = secs(t0);
    if (r > 0) best = std::max(best, 2.0 * n * n * n / s / 1e9);
  }
  return best;
}

// The same on a device: the backend's own GEMM as the model calls it (bf16 precision: with the
// operands' conversion), best of 5.
double device_gemm_gflops(Backend& be, int64_t n) {
  DevBuf<float> A, B, C;
  A.on(&be).resize(static_cast<size_t>(n * n));
  B.on(&be).resize(static_cast<size_t>(n * n));
  C.on(&be).resize(static_cast<size_t>(n * n));
  double best = 0;
  for (int r = 0; r < 6; r++) {
    be.synchronize();
    const auto t0 = Clock::now();
    be.matmul_forward(C.data(), A.data(), B.data(), n, n, n);
    be.synchronize();
    const double s = secs(t0);
    if (r > 0) best = std::max(best, 2.0 * n * n * n / s / 1e9);
  }
  return best;
}

// One mode, in this (child) process.
json bench_one(const BenchArgs& a, const std::string& mode) {
  const ModelConfig c = bench_config(a, mode);
  // Every op timed when the profiler is on (the one profiled step below); off, a branch per op.
  std::shared_ptr<Backend> be = make_profiled_backend(open_backend(a.dev));
  if (!be->is_cpu()) {  // profiled scopes wait for the device, so they time its work
    prof::set_synchronizer([](void* b) { static_cast<Backend*>(b)->synchronize(); }, be.get());
  }
  Model m(c, be);
  m.init_weights(1);
  const int64_t B = a.batch, T = a.seq_len, N = B * T;
  std::vector<int32_t> tok(N), tgt(N);
  Rng rng(7);
  for (int64_t i = 0; i < N; i++) {
    tok[i] = static_cast<int32_t>(rng.next_u64() % c.vocab_size);
    tgt[i] = static_cast<int32_t>(rng.next_u64() % c.vocab_size);
  }
  if (!a.weights_out.empty()) {  // the same weights and batch for the PyTorch side
    SafetensorsWriter w;
    w.set_metadata("config", c.to_json());
    const std::vector<float> host = m.params_to_host();
    for (const ParamEntry& e : m.layout().entries())
      w.add_f32(e.name, e.shape, host.data() + e.offset);
    w.add_i32("tokens", {B, T}, tok.data());
    w.add_i32("targets", {B, T}, tgt.data());
    w.write(a.weights_out);
  }
  AdamW opt(m.layout(), AdamWConfig{}, be.get());
  const double loss0 = m.forward(tok.data(), tgt.data(), B, T);
  auto host_step = [&] {  // driven from the host, op by op (the profiled step)
    m.forward(tok.data(), tgt.data(), B, T);
    m.zero_grad();
    m.backward();
    const prof::Region pr(prof::kOptimizer);  // clipping is part of the update
    const double norm = std::sqrt(be->sum_squares(m.grads(), m.layout().total()));
    opt.step(m.params(), m.grads(), 1e-4, clip_scale(norm, 1.0));
    be->synchronize();
  };
  // On a device the timed steps run as `train` runs them (train/device_step.hpp): no wait for
  // the host inside a step, and with --cuda-graphs replayed from graphs.
  std::unique_ptr<DeviceStep> ds;
  if (!be->is_cpu()) ds = std::make_unique<DeviceStep>(m, opt, 1.0, 1.0f, a.cuda_graphs);
  auto step = [&] {
    if (!ds) return host_step();
    ds->begin();
    ds->micro(tok.data(), tgt.data(), B, T);
    ds->finish(1e-4);  // (reads the step's loss back: waits for the device)
  };
  // (with graphs the first step runs uncaptured and the second captures: both untimed)
  const int64_t warmup = ds && a.cuda_graphs ? std::max<int64_t>(a.warmup, 2) : a.warmup;
  for (int64_t i = 0; i < warmup; i++) step();
  std::vector<double> times;
  for (int64_t i = 0; i < a.steps; i++) {
    const auto t0 = Clock::now();
    step();
    times.push_back(secs(t0));
  }
  const int64_t graph_replays = ds ? ds->replays() : 0;
  prof::reset();
  prof::enable(true);
  const auto tp = Clock::now();
  host_step();
  const double prof_total = secs(tp);
  prof::enable(false);
  json ops = json::object();
  for (int op = 0; op < prof::kOpCount; op++) {
    ops[prof::op_name(op)] = {prof::seconds(op, prof::kForward),
                              prof::seconds(op, prof::kBackward)};
  }
  // Inference: prefill T/2 tokens, then decode one token at a time.
  const int64_t P = std::max<int64_t>(1, T / 2);
  Decoder dec(m, c.max_seq_len);
  std::vector<double> pre, dect;
  for (int r = 0; r < 3; r++) {
    dec.reset();
    const auto t0 = Clock::now();
    dec.feed(tok.data(), P);
    pre.push_back(secs(t0));
  }
  int32_t t = tok[static_cast<size_t>(P) % tok.size()];  // (P = 1 = tok.size() at B = T = 1)
  for (int64_t i = 0; i < a.decode_tokens; i++) {
    const auto t0 = Clock::now();
    const float* l = dec.feed(&t, 1);
    dect.push_back(secs(t0));
    t = static_cast<int32_t>(std::max_element(l, l + c.vocab_size) - l);
  }
  prof::set_synchronizer(nullptr, nullptr);  // the backend goes with this function
  struct rusage ru {};
  ::getrusage(RUSAGE_SELF, &ru);
  const double step_s = median(times);
  const double fpt = train_flops_per_token(c, T);
  return {{"mode", mode},
          {"params", m.num_params()},
          {"loss0", loss0},
          {"step_s", step_s},
          {"tokens_per_s", N / step_s},
          {"threads", omp_get_max_threads()},  // (the threads the steps were timed on)
          {"model_gflops", N * fpt / step_s / 1e9},
          {"flops_per_token", fpt},
          {"profile_step_s", prof_total},
          {"ops", ops},
          {"prefill_tokens", P},
          {"prefill_tokens_per_s", P / median(pre)},
          {"decode_ms_per_token", ms_per_token(dect)},
          {"activation_bytes", m.activation_bytes()},
          {"graph_replays", graph_replays},
          {"peak_rss_mib", ru.ru_maxrss / 1024.0}};
}

// Inference latency of every mode side by side in ONE process: prefill rounds and then single
// tokens interleaved mode by mode (A B C A B C ...), so machine noise and process-to-process
// differences (page placement, huge pages) hit every mode alike; medians per mode.
json inference_interleaved(const BenchArgs& a, const std::vector<std::string>& modes) {
  const int64_t T = a.seq_len, P = std::max<int64_t>(1, T / 2);
  std::vector<std::unique_ptr<Model>> models;
  std::vector<std::unique_ptr<Decoder>> decs;
  // Every op timed when the profiler is on (the one profiled step below); off, a branch per op.
  std::shared_ptr<Backend> be = make_profiled_backend(open_backend(a.dev));
  for (const auto& mode : modes) {
    models.push_back(std::make_unique<Model>(bench_config(a, mode), be));
    models.back()->init_weights(1);
    decs.push_back(std::make_unique<Decoder>(*models.back(), models.back()->config().max_seq_len));
  }
  std::vector<int32_t> tok(P + 1);
  Rng rng(7);
  for (auto& t : tok) t = static_cast<int32_t>(rng.next_u64() % a.vocab);
  const size_t M = modes.size();
  std::vector<std::vector<double>> pre(M), dec(M);
  for (int r = 0; r < 5; r++) {
    for (size_t i = 0; i < M; i++) {
      decs[i]->reset();
      const auto t0 = Clock::now();
      decs[i]->feed(tok.data(), P);
      pre[i].push_back(secs(t0));
    }
  }
  std::vector<int32_t> next(M, tok[P]);
  for (int64_t k = 0; k < a.decode_tokens; k++) {
    for (size_t i = 0; i < M; i++) {
      const auto t0 = Clock::now();
      const float* l = decs[i]->feed(&next[i], 1);
      dec[i].push_back(secs(t0));
      next[i] = static_cast<int32_t>(std::max_element(l, l + a.vocab) - l);
    }
  }
  json out = json::array();
  for (size_t i = 0; i < M; i++) {
    out.push_back({{"mode", modes[i]},
                   {"prefill_tokens_per_s", P / median(pre[i])},
                   {"decode_ms_per_token", ms_per_token(dec[i])}});
  }
  return out;
}

std::string self_args(const BenchArgs& a) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "--d-model %lld --n-layer %lld --n-head %lld --seq-len %lld --batch-size %lld "
                "--vocab %lld --block-size %lld --steps %lld --warmup %lld --decode-tokens %lld "
                "--device %s --precision %s --attnres-two-phase %s%s",
                static_cast<long long>(a.d_model), static_cast<long long>(a.n_layer),
                static_cast<long long>(a.n_head), static_cast<long long>(a.seq_len),
                static_cast<long long>(a.batch), static_cast<long long>(a.vocab),
                static_cast<long long>(a.block_size), static_cast<long long>(a.steps),
                static_cast<long long>(a.warmup), static_cast<long long>(a.decode_tokens),
                to_string(a.dev.device), to_string(a.dev.precision), a.two_phase ? "true" : "false",
                a.cuda_graphs ? " --cuda-graphs" : "");
  return buf;
}

// Runs a command; returns its stdout's last line that starts with '{' (or "").
std::string last_json_line(const std::string& cmd, std::string* all = nullptr) {
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return "";
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  ::pclose(p);
  if (all) *all = out;
  std::string last;
  size_t pos = 0;
  while (pos < out.size()) {
    size_t e = out.find('\n', pos);
    if (e == std::string::npos) e = out.size();
    if (out[pos] == '{') last = out.substr(pos, e - pos);
    pos = e + 1;
  }
  return last;
}

// A comma-separated list, empty items dropped.
std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : list + ",") {
    if (ch == ',') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur += ch;
    }
  }
  return out;
}

// x / base, or "-" where there is no base to divide by (no PreNorm among the modes).
std::string ratio_text(double x, const json* base, const char* key, int width) {
  char b[32];
  if (base && (*base)[key].is_number()) {
    std::snprintf(b, sizeof b, "%*.3f", width, x / (*base)[key].get<double>());
  } else {
    std::snprintf(b, sizeof b, "%*s", width, "-");
  }
  return b;
}

const json* prenorm_row(const json& rows) {
  for (const auto& r : rows) {
    if (r["mode"] == "prenorm") return &r;
  }
  return nullptr;
}

// The GEMM the model's GFLOP/s are measured against, and the fp32 sgemm where it was measured.
struct Ceiling {
  double gflops = 0;
  std::string of;                      // e.g. "bf16 matmul (oneDNN), 2048^3"
  std::optional<double> sgemm_gflops;  // the CPU's fp32 sgemm, 2048^3
};

// The setup line and the GEMM ceiling the model's GFLOP/s are measured against.
Ceiling print_setup_and_ceiling(const BenchArgs& a) {
  std::printf(
      "attnres bench: d %lld, %lld layers, %lld heads, T %lld, B %lld, vocab %lld, "
      "%d threads; %lld timed steps after %lld warm-up (medians)\n",
      static_cast<long long>(a.d_model), static_cast<long long>(a.n_layer),
      static_cast<long long>(a.n_head), static_cast<long long>(a.seq_len),
      static_cast<long long>(a.batch), static_cast<long long>(a.vocab), omp_get_max_threads(),
      static_cast<long long>(a.steps), static_cast<long long>(a.warmup));
  Ceiling ceiling;
  if (a.dev.device == Device::cpu && a.dev.precision == MatmulPrecision::fp32) {
    std::fflush(stdout);
    ceiling.gflops = sgemm_gflops(2048);
    ceiling.sgemm_gflops = ceiling.gflops;
    ceiling.of = "fp32 sgemm (oneDNN), 2048^3";
    std::printf("sgemm ceiling (2048^3, oneDNN): %.1f GFLOP/s\n\n", ceiling.gflops);
  } else if (a.dev.device == Device::cpu) {  // bf16: the product the linear layers use
    std::fflush(stdout);
    const double fp32 = sgemm_gflops(2048);
    const char* how = cpu_has_bf16() ? "(oneDNN matmul)" : "(widened to fp32: no AVX512-BF16)";
    ceiling.gflops = device_gemm_gflops(*open_backend(a.dev), 2048);
    ceiling.sgemm_gflops = fp32;
    ceiling.of = std::string("bf16 ") + how + ", 2048^3";
    std::printf(
        "GEMM ceiling (2048^3): fp32 sgemm %.1f GFLOP/s, bf16 %s %.1f GFLOP/s (%.2fx); "
        "%%ceiling below is of bf16's\n\n",
        fp32, how, ceiling.gflops, ceiling.gflops / fp32);
  } else {
    // Every op timed when the profiler is on (the one profiled step below); off, a branch per op.
    std::shared_ptr<Backend> be = make_profiled_backend(open_backend(a.dev));
    const int64_t n = a.dev.device == Device::cuda_host ? 256 : 4096;  // the emulation is slow
    std::printf("device %s, %s matrix products\n", be->name().c_str(), to_string(a.dev.precision));
    std::fflush(stdout);
    ceiling.gflops = device_gemm_gflops(*be, n);
    ceiling.of = std::string("the device's GEMM at ") + to_string(a.dev.precision) + ", " +
                 std::to_string(n) + "^3";
    std::printf("sgemm ceiling (%lld^3, the device's GEMM at %s): %.1f GFLOP/s\n\n",
                static_cast<long long>(n), to_string(a.dev.precision), ceiling.gflops);
  }
  std::fflush(stdout);
  return ceiling;
}

// Each mode trained in a child process, modes interleaved round by round (A B C A B C ...), so
// slow phases of the machine hit every mode alike; each mode's median-time round.
json run_rounds(const BenchArgs& a, const std::vector<std::string>& modes,
                const std::string& weights) {
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  std::vector<std::vector<json>> rounds(modes.size());
  for (int64_t rep = 0; rep < a.repeats; rep++) {
    for (size_t mi = 0; mi < modes.size(); mi++) {
      const std::string& mode = modes[mi];
      // (the child times the steps: it runs on the threads this bench was given, as reported)
      const std::string threads =
          requested_threads() > 0 ? "--threads " + std::to_string(requested_threads()) + " " : "";
      // exec: the child replaces the shell, so it is this process's own and dies with it
      std::string cmd =
          "exec '" + self + "' " + threads + "bench --child-mode " + mode + " " + self_args(a);
      if (mode == "prenorm" && rep == 0 && !a.torch_pythons.empty())
        cmd += " --weights-out " + weights;
      std::string all;
      const std::string line = last_json_line(cmd + " 2>&1", &all);
      check(!line.empty(), "benchmark of mode " + mode + " failed:\n" + all);
      rounds[mi].push_back(json::parse(line));
      std::printf("  %-8s round %lld: %.1f tok/s%s\n", mode.c_str(),
                  static_cast<long long>(rep + 1), rounds[mi].back()["tokens_per_s"].get<double>(),
                  rounds[mi].back().value("graph_replays", int64_t{0}) > 0
                      ? " (steps replayed from CUDA graphs)"
                      : "");
      std::fflush(stdout);
    }
  }
  json out = json::array();
  for (auto& rs : rounds) {
    std::sort(rs.begin(), rs.end(), [](const json& x, const json& y) {
      return x["step_s"].get<double>() < y["step_s"].get<double>();
    });
    json r = rs[rs.size() / 2];
    r["rounds"] = static_cast<int64_t>(rs.size());
    out.push_back(r);
  }
  return out;
}

// The training table (ratios to PreNorm's where it ran) and where the time goes (one profiled
// step; forward / backward ms per op family).
void print_training(const json& rows, double ceiling, bool on_cpu) {
  const json* base = prenorm_row(rows);
  std::printf("\n%-9s %9s %9s %10s %8s %9s %10s %9s %11s %11s\n", "mode", "step ms", "tok/s",
              "GFLOP/s", "%sgemm", "vs base", "peak MiB", "vs base", "prefill t/s", "decode ms/t");
  for (const auto& r : rows) {
    const double tps = r["tokens_per_s"], mem = r["peak_rss_mib"];
    std::printf("%-9s %9.1f %9.0f %10.1f %7.1f%% %s %10.0f %s %11.0f %s\n",
                r["mode"].get<std::string>().c_str(), 1e3 * r["step_s"].get<double>(), tps,
                r["model_gflops"].get<double>(), 100.0 * r["model_gflops"].get<double>() / ceiling,
                ratio_text(tps, base, "tokens_per_s", 9).c_str(), mem,
                ratio_text(mem, base, "peak_rss_mib", 9).c_str(),
                r["prefill_tokens_per_s"].get<double>(),
                figure(r["decode_ms_per_token"], 11, 2).c_str());
  }
  if (!on_cpu) std::printf("(peak MiB: the host process's resident memory, not the device's)\n");
  std::printf("\nper-op time of one step, ms (forward / backward):\n%-20s", "op");
  for (const auto& r : rows) std::printf(" %17s", r["mode"].get<std::string>().c_str());
  std::printf("\n");
  for (int op = 0; op < prof::kOpCount; op++) {
    std::printf("%-20s", prof::op_name(op));
    for (const auto& r : rows) {
      const auto& v = r["ops"][prof::op_name(op)];
      std::printf(" %8.1f /%7.1f", 1e3 * v[0].get<double>(), 1e3 * v[1].get<double>());
    }
    std::printf("\n");
  }
}

// Inference side by side in this process (the per-child figures vary from process to process by
// several percent; this is the comparison to trust).
json print_inference(const BenchArgs& a, const std::vector<std::string>& modes) {
  const json inf = inference_interleaved(a, modes);
  std::printf(
      "\ninference, all modes in one process, interleaved (medians; prefill %lld tokens, "
      "then %lld single tokens):\n%-9s %12s %9s %12s %9s\n",
      static_cast<long long>(std::max<int64_t>(1, a.seq_len / 2)),
      static_cast<long long>(a.decode_tokens), "mode", "prefill t/s", "vs base", "decode ms/t",
      "vs base");
  const json* b = prenorm_row(inf);
  for (const auto& r : inf) {
    const double pt = r["prefill_tokens_per_s"];
    const json& dm = r["decode_ms_per_token"];
    std::printf("%-9s %12.0f %s %s %s\n", r["mode"].get<std::string>().c_str(), pt,
                ratio_text(pt, b, "prefill_tokens_per_s", 9).c_str(), figure(dm, 12, 3).c_str(),
                dm.is_number() ? ratio_text(dm.get<double>(), b, "decode_ms_per_token", 9).c_str()
                               : "        -");
  }
  std::fflush(stdout);
  return inf;
}

// PyTorch on the identical model and batch (tools/bench_torch.py), same loss required.
json compare_torch(const BenchArgs& a, const json& base, const std::string& weights,
                   std::vector<std::string>* failed) {
  json out = json::array();
  for (const std::string& py : split_list(a.torch_pythons)) {
    char extra[128];
    const bool bf16 = a.dev.precision == MatmulPrecision::bf16;  // (torch: CPU bf16 autocast)
    std::snprintf(extra, sizeof extra, " --steps %lld --warmup %lld --threads %d%s",
                  static_cast<long long>(a.steps), static_cast<long long>(a.warmup),
                  omp_get_max_threads(), bf16 ? " --bf16" : "");
    const std::string script = (fs::path(ATTNRES_SOURCE_DIR) / "tools" / "bench_torch.py").string();
    std::string all;
    const std::string line =
        last_json_line(py + " " + script + " " + weights + extra + " 2>&1", &all);
    if (line.empty()) {
      std::printf("\nPyTorch (%s) failed:\n%s\n", py.c_str(), all.c_str());
      failed->push_back(py);
      continue;
    }
    json parsed = json::parse(line);  // kept alive for the loop below
    for (auto& t : parsed["setups"]) {
      const double ours = base["tokens_per_s"], loss_c = base["loss0"];
      t["python"] = py;
      // (bf16: each side rounds other intermediates, so to bf16's rounding of the loss)
      const double tol = a.dev.precision == MatmulPrecision::bf16 ? 1e-2 : 1e-3;
      t["same_loss"] = std::abs(t["loss0"].get<double>() - loss_c) < tol * std::abs(loss_c);
      t["attnres_speedup"] = ours / t["tokens_per_s"].get<double>();
      out.push_back(t);
    }
  }
  std::printf("\nPyTorch on the same weights and batch (prenorm):\n%-36s %10s %10s %12s %9s\n",
              "setup", "tok/s", "loss", "attnres x", "same loss");
  std::printf("%-36s %10.0f %10.5f %12s %9s\n", "attnres", base["tokens_per_s"].get<double>(),
              base["loss0"].get<double>(), "1.00", "-");
  for (const auto& t : out) {
    std::printf("%-36s %10.0f %10.5f %12.2f %9s\n", t["name"].get<std::string>().c_str(),
                t["tokens_per_s"].get<double>(), t["loss0"].get<double>(),
                t["attnres_speedup"].get<double>(), t["same_loss"].get<bool>() ? "yes" : "NO");
  }
  return out;
}

// --json replaces only an earlier bench result: any other file there (a checkpoint, a corpus, the
// `latest` of a run) is refused before the work starts.
void check_json_out(const std::string& path) {
  std::error_code ec;
  if (path.empty() || !fs::exists(fs::symlink_status(path, ec))) return;
  bool earlier = false;
  if (fs::is_regular_file(fs::symlink_status(path, ec)) && fs::file_size(path, ec) < (64 << 20)) {
    const json j = json::parse(read_file(path), nullptr, /*allow_exceptions=*/false);
    earlier = j.is_object() && (j.contains("ceiling_gflops") || j.contains("sgemm_gflops")) &&
              j.contains("modes");
  }
  check(earlier, "--json '" + path +
                     "' exists and is not the output of an earlier `attnres bench --json`; "
                     "give a new file name (bench replaces only its own results)");
}

void run_bench(const BenchArgs& a) {
  if (!a.child_mode.empty()) {
    // A bench stopped by `kill PID` (a scheduler, a supervisor) takes its running child along.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);  // (it holds nothing to save)
    check(::getppid() != 1, "the bench that started this --child-mode run has ended");
    std::printf("%s\n", bench_one(a, a.child_mode).dump().c_str());
    return;
  }
  open_backend(a.dev);  // bad --device / --precision: an error before any work
  check_json_out(a.json_out);
  check(!a.cuda_graphs || a.dev.device != Device::cpu,
        "--cuda-graphs captures the steps on --device cuda (or cuda-host, its emulation)");
  check(a.torch_pythons.empty() || a.dev.device == Device::cpu,
        "--torch compares with PyTorch on the CPU: drop --torch, or use --device cpu");
  const std::vector<std::string> modes = split_list(a.modes);
  check(!modes.empty(), "--modes lists no residual mode (e.g. --modes prenorm,full,block)");
  for (size_t i = 0; i < modes.size(); i++) {
    for (size_t j = i + 1; j < modes.size(); j++)
      check(modes[i] != modes[j], "--modes lists '" + modes[i] + "' twice");
  }
  check(a.torch_pythons.empty() || std::find(modes.begin(), modes.end(), "prenorm") != modes.end(),
        "--torch compares PreNorm with PyTorch: include prenorm in --modes");
  const ModelConfig probe = bench_config(a, "prenorm");
  const Ceiling c = print_setup_and_ceiling(a);
  const double ceiling = c.gflops;
  // (sgemm_gflops: the fp32 sgemm alone; a bf16 run kept its bf16 ceiling there; fifteenth pass)
  json results = {{"config", json::parse(probe.to_json())},
                  {"batch_size", a.batch},
                  {"seq_len", a.seq_len},
                  {"threads", omp_get_max_threads()},
                  {"device", to_string(a.dev.device)},
                  {"precision", to_string(a.dev.precision)},
                  {"ceiling_gflops", c.gflops},
                  {"ceiling_of", c.of},
                  {"block_size", a.block_size},
                  {"attnres_two_phase", a.two_phase}};
  if (c.sgemm_gflops) results["sgemm_gflops"] = *c.sgemm_gflops;
  const std::string weights =
      (fs::temp_directory_path() / ("attnres_bench_" + std::to_string(::getpid()) + ".safetensors"))
          .string();
  results["modes"] = run_rounds(a, modes, weights);
  print_training(results["modes"], ceiling, a.dev.device == Device::cpu);
  results["inference_interleaved"] = print_inference(a, modes);
  const json* base = prenorm_row(results["modes"]);
  std::vector<std::string> torch_failed;
  if (!a.torch_pythons.empty() && base) {
    results["torch"] = compare_torch(a, *base, weights, &torch_failed);
    std::error_code ec;
    fs::remove(weights, ec);
  }
  if (!a.json_out.empty()) {
    write_file_atomic(a.json_out, results.dump(1) + "\n");
    std::printf("\nwrote %s\n", a.json_out.c_str());
  }
  std::string names;
  for (const std::string& py : torch_failed) names += (names.empty() ? "" : ", ") + py;
  check(torch_failed.empty(),
        "--torch: the PyTorch comparison with " + names +
            " failed (its output is above): give a Python with PyTorch, e.g. /usr/bin/python3 "
            "with python3-torch installed; the attnres figures above were measured" +
            (a.json_out.empty() ? std::string() : " and written to " + a.json_out));
}

}  // namespace

void add_bench(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  CLI::App* s = app.add_subcommand(
      "bench", "Measure training and inference speed and memory per residual mode");
  s->add_option("--d-model", a->d_model, "Model width")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 16));
  s->add_option("--n-layer", a->n_layer, "Transformer blocks")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 10));
  s->add_option("--n-head", a->n_head, "Attention heads")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 10));
  s->add_option("--seq-len", a->seq_len, "Sequence length T")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  s->add_option("--batch-size", a->batch, "Sequences per step")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  s->add_option("--vocab", a->vocab, "Vocabulary size")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 24));
  s->add_option("--modes", a->modes, "Residual modes, comma-separated")->capture_default_str();
  s->add_option("--block-size", a->block_size, "Block size of mode block")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 10));
  s->add_option("--attnres-two-phase", a->two_phase,
                "full and block: the two-phase computation (SPEC 4: mixers that share one pass "
                "over the older sources); false measures what it gains. Same function")
      ->capture_default_str();
  s->add_option("--steps", a->steps, "Timed training steps (median reported)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  s->add_option("--warmup", a->warmup, "Untimed warm-up steps")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  s->add_option("--decode-tokens", a->decode_tokens, "Tokens decoded one at a time")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  s->add_option("--repeats", a->repeats,
                "Rounds over all modes, interleaved; each mode reports its median round")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  s->add_option("--json", a->json_out, "Also write the results as JSON to this file");
  add_device_options(s, a->dev);
  s->add_flag("--cuda-graphs", a->cuda_graphs,
              "On a device, time the steps replayed from CUDA graphs (as train --cuda-graphs)");
  s->add_option(
      "--torch", a->torch_pythons,
      "Python interpreter(s) with PyTorch, comma-separated, to run tools/bench_torch.py "
      "on the same weights and batch (e.g. /usr/bin/python3); with --precision bf16, under "
      "PyTorch's CPU bf16 autocast");
  s->add_option("--child-mode", a->child_mode, "(internal)")->group("");
  s->add_option("--weights-out", a->weights_out, "(internal)")->group("");
  s->callback([a, s] {
    // Options that size what --modes does not run would be taken and do nothing.
    // (a --child-mode run is given every size by its parent)
    const std::vector<std::string> modes = split_list(a->modes);
    auto runs = [&](const char* m) {
      return !a->child_mode.empty() || std::find(modes.begin(), modes.end(), m) != modes.end();
    };
    check(s->count("--block-size") == 0 || runs("block"),
          "--block-size sizes the blocks of mode block, but --modes '" + a->modes +
              "' does not run it: drop it, or add block to --modes");
    check(s->count("--attnres-two-phase") == 0 || runs("full") || runs("block"),
          "--attnres-two-phase sets how full and block compute their depth mix, but --modes '" +
              a->modes + "' runs neither: drop it, or add full or block to --modes");
    run_bench(*a);
  });
}

}  // namespace attnres::cli
