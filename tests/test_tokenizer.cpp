// Tests for attnres/tokenizer.hpp: byte tokenizer and SentencePiece BPE training/loading.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "attnres/data.hpp"
#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/tokenizer.hpp"
#include "core/rng.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using namespace attnres;

namespace {

using attnres::testing::TempDir;

// Deterministic English-like text: sentences of common words with punctuation and newlines.
std::string english_like(int sentences, uint64_t seed) {
  static const char* kWords[] = {
      "the",   "of",    "and",     "to",    "in",        "a",        "is",     "that",    "for",
      "it",    "as",    "was",     "with",  "be",        "by",       "on",     "not",     "he",
      "this",  "are",   "or",      "his",   "from",      "at",       "which",  "but",     "have",
      "an",    "had",   "they",    "you",   "were",      "their",    "one",    "all",     "we",
      "can",   "her",   "has",     "there", "been",      "if",       "more",   "when",    "will",
      "would", "who",   "so",      "no",    "model",     "train",    "token",  "layer",   "weight",
      "data",  "learn", "network", "value", "attention", "residual", "vector", "matrix",  "quick",
      "brown", "fox",   "jumps",   "over",  "lazy",      "dog",      "river",  "mountain"};
  const size_t nw = sizeof(kWords) / sizeof(kWords[0]);
  std::string out;
  uint64_t s = seed;
  for (int i = 0; i < sentences; ++i) {
    int len = 4 + static_cast<int>(splitmix64(s++) % 10);
    for (int w = 0; w < len; ++w) {
      std::string word = kWords[splitmix64(s++) % nw];
      if (w == 0) word[0] = static_cast<char>(word[0] - 'a' + 'A');
      out += word;
      out += (w + 1 < len) ? " " : ".";
    }
    out += (splitmix64(s++) % 4 == 0) ? "\n" : " ";
  }
  return out;
}

}  // namespace

TEST(ByteTokenizer, RoundTripsArbitraryBytes) {
  auto tok = make_byte_tokenizer();
  EXPECT_EQ(tok->vocab_size(), 256);
  EXPECT_EQ(tok->ref(), "byte");
  std::string all;
  for (int i = 0; i < 256; ++i) all.push_back(static_cast<char>(i));
  all += std::string("\xff\xfe\xc3(\0tail", 9);  // invalid UTF-8 and an embedded NUL
  std::vector<int32_t> ids = tok->encode(all);
  ASSERT_EQ(ids.size(), all.size());
  for (size_t i = 0; i < 256; ++i) EXPECT_EQ(ids[i], static_cast<int32_t>(i));
  EXPECT_EQ(tok->decode(ids), all);
  EXPECT_TRUE(tok->encode("").empty());
  EXPECT_EQ(tok->decode({}), "");
  EXPECT_THROW(tok->decode({256}), Error);
  EXPECT_THROW(tok->decode({-1}), Error);
  EXPECT_EQ(load_tokenizer("byte", "/nonexistent")->ref(), "byte");
}

TEST(SentencePiece, TrainsRoundTripsDeterministicallyAndLoads) {
  TempDir d;
  const std::string text = english_like(1500, 42);
  const std::string m1 = d.file("tok1.model"), m2 = d.file("tok2.model");
  // The minimum is 257 + one piece per distinct character (~50 here); 400 leaves ~90 merges.
  train_sentencepiece(text, 400, m1);
  train_sentencepiece(text, 400, m2);
  EXPECT_EQ(read_file(m1), read_file(m2)) << "training must be deterministic";

  auto tok = load_sentencepiece(m1);
  EXPECT_EQ(tok->vocab_size(), 400);
  EXPECT_EQ(tok->ref(), "sentencepiece:tok1.model");
  EXPECT_EQ(tok->model_data(), read_file(m1));

  // Exact round trips, including whitespace runs, leading spaces, newlines, tabs, unseen
  // characters (byte fallback) and non-ASCII text.
  const std::vector<std::string> samples = {
      text.substr(0, 2000),
      "  leading spaces and trailing  \n\n\tindented\n",
      "The quick brown fox jumps over the lazy dog.",
      "Ünïcödé — 日本語のテキスト 🙂 and emoji",
      "code: for (int i = 0; i < n; ++i) { x[i] = y[i]; }",
      "",
      "\n",
      "a"};
  for (const auto& s : samples) {
    std::vector<int32_t> ids = tok->encode(s);
    for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < tok->vocab_size());
    EXPECT_EQ(tok->decode(ids), s) << "round trip failed for: " << s;
  }
  // BPE should compress English well beyond one token per byte.
  std::vector<int32_t> ids = tok->encode(text);
  EXPECT_LT(ids.size() * 2, text.size());

  // Chunked parallel encoding is identical to a single encode.
  EXPECT_EQ(encode_parallel(*tok, text, 256), ids);

  auto via_ref = load_tokenizer("sentencepiece:tok1.model", d.path);
  EXPECT_EQ(via_ref->encode(text), ids);
  EXPECT_EQ(via_ref->ref(), tok->ref());
}

TEST(SentencePiece, VocabSizeErrors) {
  TempDir d;
  const std::string text = english_like(200, 7);
  try {
    train_sentencepiece(text, 100, d.file("small.model"));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("too small"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--vocab-size"), std::string::npos) << e.what();
  }
  try {
    train_sentencepiece(text, 50000, d.file("large.model"));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("too large"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--vocab-size"), std::string::npos) << e.what();
  }
  try {
    train_sentencepiece(text, 260, d.file("chars.model"));  // fewer than 257 + distinct chars
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("one piece per distinct character"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("--vocab-size >= 3"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(d.file("small.model")));
  EXPECT_FALSE(fs::exists(d.file("chars.model")));
  EXPECT_FALSE(fs::exists(d.file("large.model")));
  EXPECT_THROW(train_sentencepiece("\n\n", 400, d.file("blank.model")), Error);
}

TEST(SentencePiece, MissingAndCorruptModelFiles) {
  TempDir d;
  try {
    load_sentencepiece(d.file("missing.model"));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing.model"), std::string::npos) << e.what();
  }
  write_file_atomic(d.file("corrupt.model"), "this is not a protobuf \xff\xff\xff\xff");
  try {
    load_sentencepiece(d.file("corrupt.model"));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("corrupt.model"), std::string::npos) << e.what();
  }
  // Eighteenth hostile pass: a huge file (sparse here) was read whole, 20 GB past a timeout.
  {
    std::ofstream(d.file("huge.model")).close();
    std::filesystem::resize_file(d.file("huge.model"), kMaxSentencePieceBytes + 1);
    try {
      load_sentencepiece(d.file("huge.model"));
      FAIL() << "a tokenizer model over the bound was read";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("huge.model"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("larger than"), std::string::npos) << e.what();
    }
  }
  try {
    load_tokenizer("sentencepiece:gone.model", d.path);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gone.model"), std::string::npos) << e.what();
  }
  EXPECT_THROW(load_tokenizer("wordpiece:x", d.path), Error);
  EXPECT_THROW(load_tokenizer("sentencepiece:", d.path), Error);
}
