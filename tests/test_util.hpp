// Shared test helpers: random buffers and finite-difference gradient checking.
#pragma once

#include <stdlib.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/rng.hpp"

namespace attnres::testing {

// A fresh directory under the system temp dir, removed with everything in it at scope exit.
struct TempDir {
  std::string path;
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "attnres_test_XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return path + "/" + name; }
};

// The whole content of a file ("" if it cannot be read). A read error, e.g. /proc/PID/environ of
// a process that ended meanwhile (ESRCH), throws from libstdc++'s filebuf: "" too.
inline std::string slurp(const std::filesystem::path& p) {
  try {
    std::ifstream f(p, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(f)), {});
  } catch (const std::exception&) {
    return "";
  }
}

#ifdef ATTNRES_CLI_PATH
// Runs the attnres executable with `args` (a shell fragment); stdout and stderr together.
struct CliRun {
  int code = -1;
  std::string out;
};
// `prefix` goes before the command in the shell (e.g. "ulimit -v 3000000; exec ").
inline CliRun run_cli(const std::string& args, const std::string& prefix = "") {
  const std::string cmd = prefix + std::string(ATTNRES_CLI_PATH) + " " + args + " 2>&1";
  CliRun r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int st = ::pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}
#endif

inline std::vector<float> randn(int64_t n, uint64_t seed, double scale = 1.0) {
  Rng r(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(scale * r.normal());
  return v;
}

// Relative difference of two vectors: ||a-b|| / max(||a||, ||b||, floor).
inline double rel_diff(const float* a, const float* b, int64_t n, double floor = 1e-12) {
  double num = 0, na = 0, nb = 0;
  for (int64_t i = 0; i < n; i++) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    na += double(a[i]) * a[i];
    nb += double(b[i]) * b[i];
  }
  return std::sqrt(num) / std::max({std::sqrt(na), std::sqrt(nb), floor});
}

// Central finite differences of loss() w.r.t. up to max_checks coordinates of x (chosen at random),
// compared with analytic[]. Returns ||fd - an|| / max(||fd||, ||an||, floor) over those
// coordinates; `floor` (default 1e-6) keeps fp32 noise on near-zero gradients from dominating.
inline double fd_check(const std::function<double()>& loss, float* x, int64_t n,
                       const float* analytic, double eps = 1e-3, int max_checks = 48,
                       uint64_t seed = 7, double floor = 1e-6) {
  Rng r(seed);
  std::vector<int64_t> idx;
  if (n <= max_checks) {
    for (int64_t i = 0; i < n; i++) idx.push_back(i);
  } else {
    for (int k = 0; k < max_checks; k++) idx.push_back(static_cast<int64_t>(r.next_u64() % n));
  }
  std::vector<float> fd, an;
  for (int64_t i : idx) {
    const float x0 = x[i];
    x[i] = static_cast<float>(x0 + eps);
    const double lp = loss();
    x[i] = static_cast<float>(x0 - eps);
    const double lm = loss();
    x[i] = x0;
    // Divide by the step actually taken (x0 +- eps is rounded to float).
    const double h = double(static_cast<float>(x0 + eps)) - double(static_cast<float>(x0 - eps));
    fd.push_back(static_cast<float>((lp - lm) / h));
    an.push_back(analytic[i]);
  }
  return rel_diff(fd.data(), an.data(), static_cast<int64_t>(fd.size()), floor);
}

// sum_i out[i] * w[i] in double: a scalar loss whose gradient w.r.t. out is w.
inline double dot(const float* out, const float* w, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; i++) s += double(out[i]) * w[i];
  return s;
}

}  // namespace attnres::testing
