// Fuzzes the corpus reader: invalid UTF-8, NUL bytes, long lines, and the parallel encoder's
// chunking of whatever text comes out.
#include <cstdlib>
#include <cstring>

#include "attnres/data.hpp"
#include "attnres/error.hpp"
#include "fuzz_util.hpp"

using namespace attnres;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);

  // Sanitizing yields valid UTF-8: a second pass replaces nothing and changes nothing.
  std::string clean;
  const int64_t replaced = append_sanitized_utf8(bytes, clean);
  std::string again;
  if (append_sanitized_utf8(clean, again) != 0 || again != clean) std::abort();
  if (replaced == 0 && clean != bytes) std::abort();

  // The bytes as a corpus file.
  const std::string path = fuzz::write_scratch("corpus.txt", data, size);
  try {
    Corpus c = read_corpus(path);
    if (std::memchr(data, 0, size) != nullptr) std::abort();  // binary files are refused
    if (c.text != clean || c.replaced_invalid_utf8 != replaced) std::abort();
    // Chunked parallel encoding equals one-piece encoding, even with tiny chunks.
    static const auto tok = make_byte_tokenizer();
    if (encode_parallel(*tok, c.text, 7) != tok->encode(c.text)) std::abort();
  } catch (const Error&) {
  }
  return 0;
}
