// tokenizer_byte.cpp — the identity byte tokenizer and the checkpoint-reference loader.
#include <string>

#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/tokenizer.hpp"

namespace attnres {

Tokenizer::~Tokenizer() = default;

namespace {

class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out(ids.size(), '\0');
    for (size_t i = 0; i < ids.size(); ++i) {
      int32_t id = ids[i];
      check(id >= 0 && id < 256, "byte tokenizer cannot decode id " + std::to_string(id) +
                                     " at position " + std::to_string(i) +
                                     " (valid ids are 0..255); the ids come from another "
                                     "tokenizer or a model with a larger vocabulary");
      out[i] = static_cast<char>(static_cast<unsigned char>(id));
    }
    return out;
  }

  int32_t vocab_size() const override { return 256; }
  std::string ref() const override { return "byte"; }
};

}  // namespace

std::unique_ptr<Tokenizer> make_byte_tokenizer() { return std::make_unique<ByteTokenizer>(); }

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& ref, const std::string& base_dir) {
  if (ref == "byte") return make_byte_tokenizer();
  const std::string prefix = "sentencepiece:";
  if (ref.compare(0, prefix.size(), prefix) == 0) {
    std::string file = ref.substr(prefix.size());
    check(!file.empty() && file.front() != '/',
          "tokenizer reference '" + ref +
              "' must name a model file relative to the checkpoint "
              "directory, e.g. 'sentencepiece:tokenizer.model'");
    std::string path = join_path(base_dir, file);
    try {
      return load_sentencepiece(path);
    } catch (const Error& e) {
      throw Error(std::string(e.what()) + " (tokenizer '" + ref + "' is resolved relative to '" +
                  (base_dir.empty() ? std::string(".") : base_dir) +
                  "'; keep the model file next to the checkpoint)");
    }
  }
  throw Error("unknown tokenizer reference '" + ref +
              "'; expected 'byte' or 'sentencepiece:<model file>' — the checkpoint may come from "
              "a newer version or be corrupt");
}

}  // namespace attnres
