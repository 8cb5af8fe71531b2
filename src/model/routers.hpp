// Constructors of the residual modes (one file each); make_router() (residual.cpp) picks one.
#pragma once

#include <memory>
#include <vector>

#include "attnres/backend.hpp"
#include "attnres/config.hpp"
#include "attnres/residual.hpp"

namespace attnres {

// Every mode runs on any backend (be: null = the CPU).
std::unique_ptr<DepthRouter> make_prenorm_router(const ModelConfig& cfg, Backend* be);
std::unique_ptr<DepthRouter> make_attnres_router(const ModelConfig& cfg,
                                                 Backend* be);  // full, block
std::unique_ptr<DepthRouter> make_static_router(const ModelConfig& cfg, Backend* be);
std::unique_ptr<DepthRouter> make_denseformer_router(const ModelConfig& cfg, Backend* be);

// Checkpoint prefix of mixer m (m < L: the mix feeding sublayer m; m == L: the output mix):
// "layers.{m/2}.attn_res.", "layers.{m/2}.mlp_res." or "out_res.".
std::string mixer_prefix(int64_t m, int64_t L);
// Display name of mixer/sublayer m: "L{m/2}.attn", "L{m/2}.mlp" or "out" (m == L).
std::string mixer_label(int64_t m, int64_t L);

}  // namespace attnres
