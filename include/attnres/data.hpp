// attnres/data.hpp — corpus reading, token caches, batch sampling and the data-prep pipeline.
//
// Flow: read_corpus (file or directory -> clean UTF-8 text) -> tokenizer (byte, or a BPE model
// trained once per corpus) -> tokens cached in an mmapped file keyed by corpus + tokenizer ->
// train/validation TokenSpans -> batches that depend only on (seed, step, micro, row), so a
// resumed run sees exactly the batches an uninterrupted run would have.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "attnres/fileio.hpp"
#include "attnres/tokenizer.hpp"

namespace attnres {

// ---------------------------------------------------------------------------------------------
// Corpus

struct Corpus {
  std::string text;                   // all included files, valid UTF-8, joined with "\n"
  std::vector<std::string> files;     // included files, in the order their text appears
  std::vector<std::string> skipped;   // "<path> (<reason>)" for each file or directory left out
  int64_t replaced_invalid_utf8 = 0;  // invalid UTF-8 sequences replaced by U+FFFD
};

// Reads a text file, or a directory recursively in sorted (byte-wise) order, skipping hidden
// entries, symlinks to files already included, symlinked directories, binary files (any NUL
// byte) and `exclude_dir` if it lies inside (so an output directory inside the corpus is not
// read back as text). Error if the path is missing, is a binary file, or yields no text.
Corpus read_corpus(const std::string& path, const std::string& exclude_dir = "");

// Appends `in` to `out` with each maximal invalid UTF-8 subpart replaced by U+FFFD; returns the
// number of replacements.
int64_t append_sanitized_utf8(std::string_view in, std::string& out);

// ---------------------------------------------------------------------------------------------
// Hashing

constexpr uint64_t kFnv1a64Offset = 0xcbf29ce484222325ULL;

// FNV-1a 64 of `data` continuing from `seed`, so fnv1a64(b, fnv1a64(a)) == fnv1a64(a + b).
uint64_t fnv1a64(std::string_view data, uint64_t seed = kFnv1a64Offset);
// A checksum of n bytes continuing from h, for integrity checks of large files (the token cache,
// safetensors): FNV-1a over 8-byte words (then the tail bytes), each step followed by a
// shift-xor so that a difference in a word's top bits reaches the bits the next multiply spreads
// (plain word-wise FNV let two flipped sign bits cancel). A word at a time: a fraction of the cost
// of reading the bytes. Not cryptographic: it finds damage and edits, not a forger.
uint64_t checksum64(const void* p, uint64_t n, uint64_t h = kFnv1a64Offset);
// v as 16 lowercase hex digits (the fingerprints in train_config.json and checkpoints).
std::string hex64(uint64_t v);

// ---------------------------------------------------------------------------------------------
// Token cache
//
// Format (little-endian): "ARTOKCCH", u32 version = 2, u32 reserved = 0, u64 count,
// u64 vocab_size, u64 key, u64 checksum, then count int32 token ids. key = fnv1a64(corpus text +
// tokenizer ref + tokenizer model bytes), so any change to the corpus or tokenizer invalidates
// the cache; checksum = checksum64 of the token ids' bytes, so a cache whose ids were altered after
// it was written (bad sectors, an edit in place) is rebuilt rather than trained on.

constexpr uint32_t kTokenCacheVersion = 2;
constexpr size_t kTokenCacheHeaderBytes = 48;

// Whether `path` starts as a token cache does (any version): a file that does not is the user's,
// never replaced by one. Error when it is not a regular file.
bool is_token_cache_file(const std::string& path);

// Writes `tokens` atomically as a token cache; Error if an id is outside [0, vocab_size).
void write_token_cache(const std::string& path, const std::vector<int32_t>& tokens,
                       int32_t vocab_size, uint64_t key);

class TokenCache {
 public:
  // Reads and validates a cache: Error (with "delete it to rebuild") on bad magic, version, size,
  // key or vocab, or any token id outside [0, vocab_size). The tokens are read into memory, not
  // mapped: a mapped file cut while the run trains killed it (SIGBUS), and one rewritten in place
  // changed the text it trained on without a word.
  static TokenCache open(const std::string& path, uint64_t expected_key, int32_t vocab_size);

  TokenCache() = default;
  TokenCache(TokenCache&&) = default;
  TokenCache& operator=(TokenCache&&) = default;
  TokenCache(const TokenCache&) = delete;
  TokenCache& operator=(const TokenCache&) = delete;
  // Token ids.
  const int32_t* data() const { return tokens_.data(); }
  // Number of tokens.
  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  // Path the cache was opened from.
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::vector<int32_t> tokens_;
};

// ---------------------------------------------------------------------------------------------
// Batches

struct Batch {
  int64_t B = 0, T = 0;
  std::vector<int32_t> inputs,
      targets;  // (B, T) row-major; targets[i] is the token after inputs[i]
};

// A non-owning view of a token sequence (a train or validation split).
class TokenSpan {
 public:
  TokenSpan() = default;
  // Views n tokens at data; the memory must outlive the span.
  TokenSpan(const int32_t* data, int64_t n);
  // Number of tokens.
  int64_t size() const { return n_; }
  // First token.
  const int32_t* data() const { return data_; }

  // Fills `out` with B random windows of T+1 tokens; row r starts at an offset drawn uniformly
  // from [0, n-T-1] by splitmix64 of (seed, step, micro, r) only. Error if n < T+1.
  void sample_batch(uint64_t seed, int64_t step, int64_t micro, int64_t B, int64_t T,
                    Batch& out) const;
  // Rows first_row .. first_row+rows-1 of that batch (out.B = rows): each rank of a data-parallel
  // run takes its slice of the global batch, and the slices join to exactly sample_batch's rows.
  void sample_rows(uint64_t seed, int64_t step, int64_t micro, int64_t first_row, int64_t rows,
                   int64_t T, Batch& out) const;
  // Number of evaluation windows: windows of T+1 tokens starting at k*T (targets don't overlap).
  int64_t num_windows(int64_t T) const;
  // Fills `out` with windows first_window .. first_window+B-1 (modulo num_windows(T), so the last
  // batch wraps around; count only rows with first_window + r < num_windows). Error if none fit.
  void window_batch(int64_t first_window, int64_t B, int64_t T, Batch& out) const;

 private:
  void check_fits(int64_t B, int64_t T) const;
  const int32_t* data_ = nullptr;
  int64_t n_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Data preparation

struct DataOptions {
  std::string corpus_path;
  TokenizerKind tokenizer = TokenizerKind::byte;
  int32_t vocab_size = 4096;  // only for bpe
  // bpe: this SentencePiece model file (e.g. an imported Hugging Face model's) instead of one
  // trained on the corpus; copied into out_dir as tokenizer.model. "" = train one.
  std::string tokenizer_model;
  std::string out_dir;        // where tokenizer.model and tokens.bin are written (created)
  double val_fraction = 0.1;  // the last val_fraction of the tokens is the validation split
  // Non-empty: the corpus must have this fingerprint (a resumed run's), checked before anything
  // is trained or written: another corpus would retrain the run's tokenizer under its weights.
  std::string expect_fingerprint;
  // Non-empty: the tokenizer must have this fingerprint (a resumed run's), checked before the
  // token cache is rebuilt with it.
  std::string expect_tokenizer_fingerprint;
};

struct PreparedData {
  std::unique_ptr<Tokenizer> tokenizer;
  std::string tokenizer_ref;   // "byte" or "sentencepiece:tokenizer.model"
  std::string tokenizer_path;  // model file path for "bpe", "" for "byte"
  std::vector<std::string> files;
  std::vector<std::string> skipped;
  int64_t corpus_bytes = 0;
  std::string fingerprint;  // of the corpus text as read (hex FNV-1a 64; the files' order counts)
  std::string tokenizer_fingerprint;  // of the tokenizer's model (hex FNV-1a 64)
  int64_t replaced_invalid_utf8 = 0;
  bool tokenizer_trained = false;  // false when an existing model for this corpus was reused
  bool cache_reused = false;       // false when tokens.bin was (re)built
  TokenCache tokens;               // owns the mapping train and val point into
  TokenSpan train, val;
};

// Reads the corpus, trains or reuses the tokenizer, tokenises (or reuses out_dir/tokens.bin) and
// splits into train/validation. Error naming the fix on bad options or a too-small corpus.
PreparedData prepare_data(const DataOptions& opt);

// Encodes text in parallel over chunks cut after '\n' (identical to tok.encode(text) for the byte
// and SentencePiece tokenizers, whose tokens never span a newline).
std::vector<int32_t> encode_parallel(const Tokenizer& tok, std::string_view text,
                                     size_t min_chunk_bytes = size_t{1} << 20);

}  // namespace attnres
