// Fuzzes the token cache reader (tokens.bin, memory-mapped and trusted by the embedding lookup
// once opened) and batch sampling over what it returns.
#include <cstdlib>

#include "attnres/data.hpp"
#include "attnres/error.hpp"
#include "fuzz_util.hpp"

using namespace attnres;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::write_scratch("tokens.bin", data, size);
  try {
    TokenCache tc = TokenCache::open(path, fuzz::kCacheKey, fuzz::kCacheVocab);
    for (int64_t i = 0; i < tc.size(); i++) {
      if (tc.data()[i] < 0 || tc.data()[i] >= fuzz::kCacheVocab) std::abort();
    }
    TokenSpan span(tc.data(), tc.size());
    Batch b;
    try {
      span.sample_batch(1, 0, 0, 2, 4, b);
      span.window_batch(0, 2, 4, b);
    } catch (const Error&) {
    }
  } catch (const Error&) {
  }
  return 0;
}
