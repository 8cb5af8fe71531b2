// `attnres info`: a checkpoint's configuration and parameter counts.
#include <cstdio>
#include <map>

#include "attnres/checkpoint.hpp"
#include "attnres/train.hpp"
#include "cli/commands.hpp"

namespace attnres::cli {

namespace {

void run_info(const std::string& path) {
  Metadata meta;
  auto model = load_model(path, &meta);
  const ModelConfig& c = model->config();
  std::printf("checkpoint: %s\n", path.c_str());
  for (const auto& [k, v] : meta) {
    if (k != "config") std::printf("  %-10s %s\n", (k + ":").c_str(), v.c_str());
  }
  std::printf("config:\n");
  std::printf("  residual    %s\n  n_layer     %lld (%lld sublayers)\n  d_model     %lld\n",
              to_string(c.residual.mode), static_cast<long long>(c.n_layer),
              static_cast<long long>(c.n_sublayers()), static_cast<long long>(c.d_model));
  std::printf("  n_head      %lld (kv %lld, head_dim %lld)\n  ffn_hidden  %lld\n",
              static_cast<long long>(c.n_head), static_cast<long long>(c.n_kv_head),
              static_cast<long long>(c.head_dim()), static_cast<long long>(c.ffn_hidden));
  std::printf(
      "  vocab_size  %lld\n  max_seq_len %lld\n  tied head   %s\n  norm_eps    %.9g\n"
      "  rope_theta  %g\n",
      static_cast<long long>(c.vocab_size), static_cast<long long>(c.max_seq_len),
      c.tied ? "yes" : "no", c.norm_eps, c.rope_theta);
  if (c.residual.is_attnres()) {
    const ResidualConfig& r = c.residual;
    std::printf("  block_size  %lld sublayers%s\n",
                static_cast<long long>(r.effective_block_size()),
                r.mode == ResidualMode::full ? " (full: one per block)" : "");
    std::printf("  depth mix   gate %s, key norm %s, %lld head(s), query %s, window %lld%s\n",
                to_string(r.gate), to_string(r.key_norm), static_cast<long long>(r.heads),
                to_string(r.query), static_cast<long long>(r.window), r.window ? "" : " (all)");
    std::printf("  key_eps     %.9g\n  temperature %.9g\n", c.key_norm_eps(), r.temperature);
  }
  // Parameter counts by role.
  std::map<std::string, int64_t> groups;
  for (const ParamEntry& e : model->layout().entries()) {
    const ParamTag& t = e.tag;
    const char* g = t.role == ParamRole::embedding ? "embedding"
                    : t.role == ParamRole::lm_head ? "lm head"
                    : t.role == ParamRole::norm    ? "norms"
                    : t.sublayer < 0               ? "other"
                    : t.sublayer % 2 == 0          ? "attention"
                                                   : "mlp";
    groups[g] += e.numel;
  }
  std::printf("parameters: %lld total\n", static_cast<long long>(model->num_params()));
  for (const auto& [g, n] : groups) {
    std::printf("  %-10s %12lld\n", g.c_str(), static_cast<long long>(n));
  }
  std::printf("training FLOPs per token at T=%lld: %.3g\n", static_cast<long long>(c.max_seq_len),
              train_flops_per_token(c, c.max_seq_len));
}

}  // namespace

void add_info(CLI::App& app) {
  auto path = std::make_shared<std::string>();
  CLI::App* s = app.add_subcommand("info", "Print a checkpoint's config and parameter counts");
  s->add_option("model,--model", *path, "model.safetensors")->required();
  s->callback([path] { run_info(*path); });
}

}  // namespace attnres::cli
