#include "report/stats.hpp"

#include <cmath>
#include <cstdio>
#include <limits>

namespace attnres::stats {

double t_quantile_975(int64_t dof) {
  // Table values for small samples; beyond 30 the Cornish-Fisher term z + (z^3 + z) / (4 dof),
  // within 0.002 of the exact quantile there.
  static const double table[] = {0,     12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365,
                                 2.306, 2.262,  2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
                                 2.120, 2.110,  2.101, 2.093, 2.086, 2.080, 2.074, 2.069,
                                 2.064, 2.060,  2.056, 2.052, 2.048, 2.045, 2.042};
  if (dof < 1) return std::numeric_limits<double>::quiet_NaN();
  if (dof <= 30) return table[dof];
  const double z = 1.959964;
  return z + (z * z * z + z) / (4.0 * static_cast<double>(dof));
}

Interval mean_interval(const std::vector<double>& xs, int min_n) {
  Interval r;
  r.n = static_cast<int>(xs.size());
  if (r.n == 0) {
    r.mean = r.lo = r.hi = std::numeric_limits<double>::quiet_NaN();
    return r;
  }
  for (double x : xs) r.mean += x / r.n;
  r.lo = r.hi = r.mean;
  if (r.n >= 2) {
    double ss = 0;
    for (double x : xs) ss += (x - r.mean) * (x - r.mean);
    r.sd = std::sqrt(ss / (r.n - 1));
    const double half = t_quantile_975(r.n - 1) * r.sd / std::sqrt(static_cast<double>(r.n));
    r.lo = r.mean - half;
    r.hi = r.mean + half;
  }
  if (r.n < min_n) {
    r.verdict = Verdict::too_few;
  } else if (r.hi < 0) {
    r.verdict = Verdict::lower;
  } else if (r.lo > 0) {
    r.verdict = Verdict::higher;
  } else {
    r.verdict = Verdict::indistinguishable;
  }
  return r;
}

const char* verdict_name(Verdict v) {
  switch (v) {
    case Verdict::lower:
      return "lower";
    case Verdict::higher:
      return "higher";
    case Verdict::indistinguishable:
      return "indistinguishable";
    case Verdict::too_few:
      return "too few seeds";
  }
  return "?";
}

double coefficient_of_variation(const std::vector<double>& xs) {
  if (xs.size() < 2) return std::numeric_limits<double>::quiet_NaN();
  const Interval iv = mean_interval(xs);
  return iv.sd / iv.mean;
}

std::string perplexity_text(double loss, int decimals) {
  const double p = std::exp(loss);
  char buf[96];
  if (!std::isfinite(p)) {
    std::snprintf(buf, sizeof buf, "e^%.1f (beyond a double)", loss);
  } else if (p < 1e15) {
    std::snprintf(buf, sizeof buf, "%.*f", decimals, p);
  } else {
    std::snprintf(buf, sizeof buf, "%.3e", p);
  }
  return buf;
}

}  // namespace attnres::stats
