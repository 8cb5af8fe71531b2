#include "report/scaling.hpp"

#include <cmath>
#include <limits>

namespace attnres::scaling {

double PowerFit::at(double C) const { return A * std::pow(C, -alpha); }

double PowerFit::compute_for(double loss) const { return std::pow(loss / A, -1.0 / alpha); }

PowerFit fit_power_law(const std::vector<double>& compute, const std::vector<double>& loss) {
  PowerFit f;
  std::vector<double> x, y;
  for (size_t i = 0; i < compute.size() && i < loss.size(); i++) {
    if (compute[i] > 0 && loss[i] > 0 && std::isfinite(compute[i]) && std::isfinite(loss[i])) {
      x.push_back(std::log(compute[i]));
      y.push_back(std::log(loss[i]));
    }
  }
  f.n = static_cast<int>(x.size());
  const double nan = std::numeric_limits<double>::quiet_NaN();
  if (f.n < 2) {
    f.A = f.alpha = f.r2 = nan;
    return f;
  }
  double mx = 0, my = 0;
  for (int i = 0; i < f.n; i++) {
    mx += x[i] / f.n;
    my += y[i] / f.n;
  }
  double sxx = 0, sxy = 0, syy = 0;
  for (int i = 0; i < f.n; i++) {
    sxx += (x[i] - mx) * (x[i] - mx);
    sxy += (x[i] - mx) * (y[i] - my);
    syy += (y[i] - my) * (y[i] - my);
  }
  if (sxx <= 0) {
    f.A = f.alpha = f.r2 = nan;
    return f;
  }
  const double slope = sxy / sxx;
  f.alpha = -slope;
  f.A = std::exp(my - slope * mx);
  f.r2 = syy > 0 ? (sxy * sxy) / (sxx * syy) : 1.0;
  return f;
}

double compute_advantage(const PowerFit& baseline, double loss, double compute) {
  return baseline.compute_for(loss) / compute;
}

double fitted_advantage(const PowerFit& baseline, const PowerFit& mode, double compute) {
  return compute_advantage(baseline, mode.at(compute), compute);
}

}  // namespace attnres::scaling
