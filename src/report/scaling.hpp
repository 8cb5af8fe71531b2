// Scaling-law fits for `attnres scale`: L = A * C^-alpha per residual mode (C = training FLOPs),
// by least squares on log L against log C, and the compute-advantage factor of one mode over
// another (SPEC 6: the paper reports 1.25x for Block AttnRes).
#pragma once

#include <vector>

namespace attnres::scaling {

struct PowerFit {
  double A = 0, alpha = 0;                // L = A * C^-alpha
  double r2 = 0;                          // of the fit in log-log space
  int n = 0;                              // points fitted
  double at(double C) const;              // A * C^-alpha
  double compute_for(double loss) const;  // the C at which the fit reaches `loss`
};

// Least squares of log(loss) = log(A) - alpha log(C) over points with C > 0 and loss > 0;
// n < 2 gives a fit with n set and A = alpha = NaN.
PowerFit fit_power_law(const std::vector<double>& compute, const std::vector<double>& loss);

// How much more compute the baseline's fit needs to reach `loss` than `compute` (> 1: the mode
// that reached `loss` with `compute` is ahead).
double compute_advantage(const PowerFit& baseline, double loss, double compute);

// The same read from two fits (the paper's reading, curve against curve): the baseline's compute
// for the loss the mode's fit gives at `compute`, over `compute`. Unlike a measured loss against
// the baseline's fit, it does not carry the baseline fit's miss of its own point there.
double fitted_advantage(const PowerFit& baseline, const PowerFit& mode, double compute);

}  // namespace attnres::scaling
