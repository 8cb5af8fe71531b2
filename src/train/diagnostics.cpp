#include "attnres/diagnostics.hpp"

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "attnres/residual.hpp"

namespace attnres {

Diagnostics measure_diagnostics(Model& model, const int32_t* tokens, int64_t B, int64_t T) {
  Diagnostics d;
  const int64_t L = model.config().n_sublayers();
  for (int64_t l = 0; l < L; l++) {
    d.sublayers.push_back("L" + std::to_string(l / 2) + (l % 2 == 0 ? ".attn" : ".mlp"));
  }
  model.set_record_stats(true);
  model.forward(tokens, nullptr, B, T);
  model.set_record_stats(false);
  d.input_rms = model.sublayer_stats().input_rms;
  d.output_rms = model.sublayer_stats().output_rms;
  d.has_weights = model.router().depth_weights(d.weights, d.weight_rows, d.weight_cols);
  return d;
}

std::string diagnostics_to_json(const Diagnostics& d) {
  auto num = [](double x) {
    return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr);
  };
  auto arr = [&](const std::vector<double>& v) {
    nlohmann::json a = nlohmann::json::array();
    for (double x : v) a.push_back(num(x));
    return a;
  };
  nlohmann::json j = {{"sublayers", d.sublayers},
                      {"input_rms", arr(d.input_rms)},
                      {"output_rms", arr(d.output_rms)},
                      {"grad_norm", arr(d.grad_norm)}};
  if (d.has_weights) {
    nlohmann::json w = nlohmann::json::array();
    for (const auto& row : d.weights) w.push_back(arr(row));
    j["depth_weights"] = {{"rows", d.weight_rows}, {"cols", d.weight_cols}, {"w", w}};
  }
  return j.dump();
}

std::string depth_weights_table(const Diagnostics& d) {
  if (!d.has_weights) return "";
  std::string out;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%-9s", "");
  out += buf;
  for (const auto& c : d.weight_cols) {
    std::snprintf(buf, sizeof buf, " %8.8s", c.c_str());
    out += buf;
  }
  out += "\n";
  for (size_t r = 0; r < d.weights.size(); r++) {
    std::snprintf(buf, sizeof buf, "%-9.9s", d.weight_rows[r].c_str());
    out += buf;
    for (double x : d.weights[r]) {
      if (std::isfinite(x)) {
        std::snprintf(buf, sizeof buf, " %7.1f%%", 100.0 * x);
      } else {
        std::snprintf(buf, sizeof buf, " %8s", ".");
      }
      out += buf;
    }
    out += "\n";
  }
  return out;
}

}  // namespace attnres
