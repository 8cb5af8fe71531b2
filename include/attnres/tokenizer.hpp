// attnres/tokenizer.hpp — text <-> token ids: a byte tokenizer and trained SentencePiece BPE.
//
// A checkpoint records its tokenizer as a short reference string (ref()): "byte", or
// "sentencepiece:<file name>" where the model file sits next to the checkpoint. load_tokenizer()
// turns such a reference back into a tokenizer.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace attnres {

// Which tokenizer a new run trains on its corpus: the byte tokenizer, or SentencePiece BPE.
enum class TokenizerKind { byte, bpe };
// "byte" / "bpe", and the parse back (Error naming the choices for anything else).
const char* to_string(TokenizerKind k);
TokenizerKind parse_tokenizer_kind(const std::string& s);

class Tokenizer {
 public:
  virtual ~Tokenizer();
  // Token ids for `text` (no BOS/EOS added). Thread-safe: may be called concurrently.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Text for `ids`; Error if an id is outside [0, vocab_size()).
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  // Number of distinct ids; every id from encode() is below it.
  virtual int32_t vocab_size() const = 0;
  // Reference stored in checkpoints: "byte" or "sentencepiece:<model file name>".
  virtual std::string ref() const = 0;
  // Serialized model the tokenizer was loaded from ("" for the byte tokenizer). Lets a checkpoint
  // writer copy the model file next to the checkpoint, and keys token caches.
  virtual std::string model_data() const { return {}; }
};

// The identity byte tokenizer: id = byte value, vocab 256, no special tokens; decode returns the
// bytes unchanged (even invalid UTF-8).
std::unique_ptr<Tokenizer> make_byte_tokenizer();

// Trains a deterministic SentencePiece BPE model (byte fallback, identity normalisation so that
// decode(encode(text)) == text, no BOS/EOS) on `text` and writes it atomically to `model_path`.
// Error with a fix if vocab_size is too small or too large for the text.
void train_sentencepiece(const std::string& text, int vocab_size, const std::string& model_path);

// Loads a SentencePiece model file; Error naming the file if it is missing or corrupt.
std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& model_path);

// Loads the tokenizer for a checkpoint reference ("byte" or "sentencepiece:<file>", the file
// resolved under base_dir); Error for an unknown reference or a missing model file, and, with
// model_vocab > 0, for a tokenizer whose vocabulary is not the model's (another run's file).
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& ref, const std::string& base_dir,
                                          int64_t model_vocab = 0);

// Smallest vocab_size train_sentencepiece accepts for any text: 256 byte pieces + <unk>.
constexpr int kMinSentencepieceVocab = 257;

}  // namespace attnres
