// Small-sample statistics for comparisons over seeds: the mean of paired differences with a
// Student-t 95 % interval, and a verdict. Plain functions of vectors; no JSON.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace attnres::stats {

// Seeds needed before a verdict other than "too few seeds" is given.
constexpr int kMinSeedsForVerdict = 3;

enum class Verdict { lower, higher, indistinguishable, too_few };

struct Interval {
  int n = 0;              // number of values
  double mean = 0;        // their mean
  double sd = 0;          // sample standard deviation (n - 1); 0 when n < 2
  double lo = 0, hi = 0;  // 95 % confidence interval of the mean (t, n - 1 dof); = mean when n < 2
  Verdict verdict = Verdict::too_few;  // lower: hi < 0; higher: lo > 0; else indistinguishable
};

// The two-sided 97.5 % quantile of Student's t with dof degrees of freedom (dof >= 1).
double t_quantile_975(int64_t dof);

// Mean and 95 % interval of xs (e.g. the per-seed differences mode - baseline), with the verdict
// on the sign of the mean: lower / higher when the interval excludes 0 and n >= min_n.
Interval mean_interval(const std::vector<double>& xs, int min_n = kMinSeedsForVerdict);

// "lower", "higher", "indistinguishable", "too few seeds".
const char* verdict_name(Verdict v);

// Coefficient of variation (sample sd / mean) of positive values; NaN if fewer than 2.
double coefficient_of_variation(const std::vector<double>& xs);

// e^loss as text: fixed with `decimals` below 1e15, in e-notation above, "e^<loss> (beyond a
// double)" past a double's range (a fixed format of a large value printed its digits cut off).
std::string perplexity_text(double loss, int decimals);

}  // namespace attnres::stats
