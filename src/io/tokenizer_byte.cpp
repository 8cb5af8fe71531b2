// tokenizer_byte.cpp — the identity byte tokenizer and the checkpoint-reference loader.
#include <string>

#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/tokenizer.hpp"

namespace attnres {

Tokenizer::~Tokenizer() = default;

namespace {

// `s` with control bytes shown as '?', for error messages about strings read from files.
std::string printable(const std::string& s) {
  std::string out = s.substr(0, 200);
  for (char& c : out) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  }
  return out;
}

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

const char* to_string(TokenizerKind k) { return k == TokenizerKind::bpe ? "bpe" : "byte"; }

TokenizerKind parse_tokenizer_kind(const std::string& s) {
  for (TokenizerKind k : {TokenizerKind::byte, TokenizerKind::bpe}) {
    if (s == to_string(k)) return k;
  }
  throw Error("unknown tokenizer '" + printable(s) + "'; use byte or bpe");
}

namespace {

std::unique_ptr<Tokenizer> load_by_ref(const std::string& ref, const std::string& base_dir) {
  if (ref == "byte") return make_byte_tokenizer();
  const std::string prefix = "sentencepiece:";
  if (ref.compare(0, prefix.size(), prefix) == 0) {
    std::string file = ref.substr(prefix.size());
    // The reference comes from a checkpoint's metadata, i.e. from outside: only a plain file
    // name next to the checkpoint is accepted, so a hostile file cannot make the engine read
    // e.g. "../../dev/zero" (an endless read) or any other file on the machine.
    check(!file.empty() && file.find('/') == std::string::npos && file != "." && file != ".." &&
              file.find('\0') == std::string::npos,
          "tokenizer reference '" + printable(ref) +
              "' must name a model file in the checkpoint's directory (a plain file name, no "
              "'/'), e.g. 'sentencepiece:tokenizer.model'; the checkpoint is corrupt or was "
              "edited");
    std::string path = join_path(base_dir, file);
    try {
      return load_sentencepiece(path);
    } catch (const Error& e) {
      throw Error(std::string(e.what()) + " (tokenizer '" + ref + "' is resolved relative to '" +
                  (base_dir.empty() ? std::string(".") : base_dir) +
                  "'; keep the model file next to the checkpoint)");
    }
  }
  throw Error("unknown tokenizer reference '" + printable(ref) +
              "'; expected 'byte' or 'sentencepiece:<model file>' — the checkpoint may come from "
              "a newer version or be corrupt");
}

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& ref, const std::string& base_dir,
                                          int64_t model_vocab) {
  std::unique_ptr<Tokenizer> t = load_by_ref(ref, base_dir);
  check(model_vocab <= 0 || t->vocab_size() == model_vocab,
        "tokenizer '" + printable(ref) + "' in '" +
            (base_dir.empty() ? std::string(".") : base_dir) + "' has a vocabulary of " +
            std::to_string(t->vocab_size()) + ", the model's is " + std::to_string(model_vocab) +
            ": it is not this model's tokenizer (restore the one saved with the checkpoint, "
            "checkpoints/step_N/" +
            ref.substr(ref.find(':') + 1) + ")");
  return t;
}

}  // namespace attnres
