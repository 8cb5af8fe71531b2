// Fuzzes tokenizer loading: SentencePiece model files (loaded as checkpoints reference them),
// the tokenizer reference string stored in checkpoint metadata, and the byte tokenizer.
#include <cstdlib>
#include <cstring>

#include "attnres/error.hpp"
#include "attnres/tokenizer.hpp"
#include "fuzz_util.hpp"

using namespace attnres;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);

  // The byte tokenizer round-trips any bytes.
  static const auto byte_tok = make_byte_tokenizer();
  if (byte_tok->decode(byte_tok->encode(bytes)) != bytes) std::abort();

  // The input as a SentencePiece model file next to a checkpoint.
  fuzz::write_scratch("tokenizer.model", data, size);
  try {
    auto tok = load_tokenizer("sentencepiece:tokenizer.model", fuzz::scratch_dir());
    const int32_t n = tok->vocab_size();
    const std::vector<int32_t> ids =
        tok->encode("The quick brown fox, \xc3\xbc\xe2\x82\xac \xff!\n");
    for (int32_t id : ids) {
      if (id < 0 || id >= n) std::abort();  // ids index the embedding table unchecked later
    }
    tok->decode(ids);
    std::vector<int32_t> raw(size / 4);
    if (!raw.empty()) std::memcpy(raw.data(), data, raw.size() * 4);
    try {
      tok->decode(raw);
    } catch (const Error&) {
    }
  } catch (const Error&) {
  }

  // The input's first line as the metadata's tokenizer reference.
  try {
    const std::string ref(bytes.substr(0, std::min<size_t>(bytes.find('\n'), 128)));
    load_tokenizer(ref, fuzz::scratch_dir());
  } catch (const Error&) {
  }
  return 0;
}
