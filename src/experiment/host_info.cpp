#include "experiment/host_info.hpp"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <fstream>
#include <memory>
#include <vector>

#include "attnres/model.hpp"
#include "backend/backend.hpp"

namespace attnres::experiment {

std::string cpu_name() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown CPU";
}

std::string now_iso() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

double time_step(const TrainConfig& cfg) {
  std::shared_ptr<Backend> be = make_backend(cfg.device, cfg.precision);
  Model m(cfg.model, be);
  m.init_weights(1);
  const int64_t n = cfg.batch_size * cfg.seq_len;
  std::vector<int32_t> tok(n);
  for (int64_t i = 0; i < n; i++) tok[i] = static_cast<int32_t>((i * 7919) % cfg.model.vocab_size);
  double best = 1e30;
  for (int r = 0; r < 3; r++) {
    const auto t0 = std::chrono::steady_clock::now();
    m.forward(tok.data(), tok.data(), cfg.batch_size, cfg.seq_len);
    m.backward();
    be->synchronize();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best = std::min(best, s);
  }
  return best * static_cast<double>(cfg.grad_accum);
}

}  // namespace attnres::experiment
