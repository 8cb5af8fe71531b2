// Progress display for long work: a redrawn one-line bar on a terminal, plain lines otherwise.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace attnres::cli {

class Progress {
 public:
  // plain_every: when stdout is not a terminal, print one line every this many steps.
  explicit Progress(int64_t plain_every);
  // Shows step/total with the given fields, e.g. "loss 2.31 | 12.4k tok/s".
  void update(int64_t step, int64_t total, const std::string& fields, double eta_s);
  // Prints a message on its own line without garbling the bar.
  void message(const std::string& m);
  // Ends the bar line.
  void finish();
  bool is_tty() const { return tty_; }

 private:
  bool tty_;
  bool drawn_ = false;
  int64_t plain_every_;
};

std::string format_duration(double s);
std::string format_count(double x);  // 12345 -> "12.3k"
// "12.3k tok/s", or "tok/s n/a" before a step was timed (the first holds the warm-up).
std::string speed_text(const std::optional<double>& tokens_per_s);

}  // namespace attnres::cli
