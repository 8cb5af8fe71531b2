// Picks the DepthRouter for a configuration's residual mode.
#include "attnres/residual.hpp"
#include "attnres/error.hpp"
#include "backend/backend.hpp"
#include "model/routers.hpp"

namespace attnres {

// (Strings are appended piecewise: GCC 12 warns falsely, -Wrestrict, on "literal" + to_string.)
std::string mixer_prefix(int64_t m, int64_t L) {
  if (m == L) return "out_res.";
  std::string s = "layers.";
  s += std::to_string(m / 2);
  s += m % 2 == 0 ? ".attn_res." : ".mlp_res.";
  return s;
}

std::string mixer_label(int64_t m, int64_t L) {
  if (m == L) return "out";
  std::string s = "L";
  s += std::to_string(m / 2);
  s += m % 2 == 0 ? ".attn" : ".mlp";
  return s;
}

std::unique_ptr<DepthRouter> make_router(const ModelConfig& cfg, Backend* be) {
  switch (cfg.residual.mode) {
    case ResidualMode::prenorm:
      return make_prenorm_router(cfg, be);
    case ResidualMode::full:
    case ResidualMode::block:
      return make_attnres_router(cfg, be);
    case ResidualMode::static_mix:
      return make_static_router(cfg, be);
    case ResidualMode::denseformer:
      return make_denseformer_router(cfg, be);
  }
  throw Error("internal: residual mode " + std::to_string(static_cast<int>(cfg.residual.mode)));
}

}  // namespace attnres
