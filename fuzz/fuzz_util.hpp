// Shared helpers of the libFuzzer targets (fuzz/*.cpp, built with -DATTNRES_FUZZ=ON).
//
// The engine reads outside data from files (it memory-maps checkpoints and token caches), so each
// target writes its input to a private scratch file and calls the same entry point the engine
// uses. A target may only see attnres::Error for bad input: any other exception, crash, sanitizer
// report, leak, timeout or huge allocation is a bug that libFuzzer reports with the input.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "attnres/config.hpp"

namespace attnres::fuzz {

// The small block-mode model whose checkpoints fuzz_safetensors loads; make_seeds writes its seeds
// from the same config.
inline ModelConfig tiny_model_config() {
  ModelConfig c;
  c.n_layer = 1;
  c.d_model = 8;
  c.n_head = 2;
  c.vocab_size = 16;
  c.ffn_hidden = 8;
  c.max_seq_len = 8;
  c.residual.mode = ResidualMode::block;
  c.residual.block_size = 2;
  return c;
}

// A scratch directory per fuzzing process, under $TMPDIR (or /tmp).
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    const char* t = std::getenv("TMPDIR");
    std::string tmpl = std::string(t && *t ? t : "/tmp") + "/attnres_fuzz_XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) std::abort();
    return tmpl;
  }();
  return dir;
}

// Replaces scratch_dir()/name with the bytes and returns its path.
inline std::string write_scratch(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = scratch_dir() + "/" + name;
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) std::abort();
  size_t off = 0;
  while (off < size) {
    ssize_t w = ::write(fd, data + off, size - off);
    if (w <= 0) std::abort();
    off += static_cast<size_t>(w);
  }
  ::close(fd);
  return path;
}

}  // namespace attnres::fuzz

namespace attnres::fuzz {
// The key and vocabulary fuzz_token_cache opens caches with (make_seeds writes its seeds so).
constexpr uint64_t kCacheKey = 0x5eed5eed5eed5eedULL;
constexpr int32_t kCacheVocab = 300;
}  // namespace attnres::fuzz
