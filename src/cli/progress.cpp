#include "cli/progress.hpp"

#include <unistd.h>

#include <cmath>
#include <cstdio>

namespace attnres::cli {

Progress::Progress(int64_t plain_every)
    : tty_(::isatty(STDOUT_FILENO) != 0), plain_every_(plain_every < 1 ? 1 : plain_every) {}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "--:--";
  const int64_t t = std::llround(s);
  char buf[32];
  if (t >= 3600) {
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", static_cast<long long>(t / 3600),
                  static_cast<long long>(t / 60 % 60), static_cast<long long>(t % 60));
  } else {
    std::snprintf(buf, sizeof buf, "%02lld:%02lld", static_cast<long long>(t / 60),
                  static_cast<long long>(t % 60));
  }
  return buf;
}

std::string format_count(double x) {
  char buf[32];
  if (x >= 1e9)
    std::snprintf(buf, sizeof buf, "%.2fG", x / 1e9);
  else if (x >= 1e6)
    std::snprintf(buf, sizeof buf, "%.2fM", x / 1e6);
  else if (x >= 1e3)
    std::snprintf(buf, sizeof buf, "%.1fk", x / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.0f", x);
  return buf;
}

void Progress::update(int64_t step, int64_t total, const std::string& fields, double eta_s) {
  if (tty_) {
    const int width = 24;
    const int filled = total > 0 ? static_cast<int>(width * step / total) : 0;
    std::string bar(filled, '#');
    bar.resize(width, '.');
    std::printf("\r\033[K[%s] %lld/%lld | %s | ETA %s", bar.c_str(), static_cast<long long>(step),
                static_cast<long long>(total), fields.c_str(), format_duration(eta_s).c_str());
    std::fflush(stdout);
    drawn_ = true;
  } else if (step % plain_every_ == 0 || step == total) {
    std::printf("step %lld/%lld | %s | ETA %s\n", static_cast<long long>(step),
                static_cast<long long>(total), fields.c_str(), format_duration(eta_s).c_str());
    std::fflush(stdout);
  }
}

void Progress::message(const std::string& m) {
  if (tty_ && drawn_) std::printf("\r\033[K");
  std::printf("%s\n", m.c_str());
  std::fflush(stdout);
  drawn_ = false;
}

void Progress::finish() {
  if (tty_ && drawn_) std::printf("\n");
  drawn_ = false;
  std::fflush(stdout);
}

std::string speed_text(const std::optional<double>& tokens_per_s) {
  return tokens_per_s ? format_count(*tokens_per_s) + " tok/s" : std::string("tok/s n/a");
}

}  // namespace attnres::cli
