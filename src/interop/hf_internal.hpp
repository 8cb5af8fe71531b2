// Pieces of the Hugging Face import shared by its files (not public API).
#pragma once

#include <string>

#include "attnres/config.hpp"

namespace attnres::hf {

// config.json of a Llama-family model as the PreNorm ModelConfig it describes (vocab, sizes,
// GQA, rms_norm_eps, rope_theta, tied head). Error naming the file and key for anything the
// engine does not compute exactly.
ModelConfig parse_config(const std::string& path);

}  // namespace attnres::hf
