// Tests for attnres/data.hpp: corpus reading, token caches, batch sampling, prepare_data.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "attnres/data.hpp"
#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "core/rng.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using namespace attnres;

namespace {

using attnres::testing::TempDir;

bool contains(const std::vector<std::string>& v, const std::string& needle) {
  for (const auto& s : v) {
    if (s.find(needle) != std::string::npos) return true;
  }
  return false;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

// Repetitive English-ish text of roughly `bytes` bytes.
std::string sample_text(size_t bytes) {
  static const char* kLines[] = {
      "The model learns to predict the next token from the previous ones.\n",
      "Attention lets every position look at all earlier positions.\n",
      "Residual connections carry the signal through many layers.\n",
      "A small corpus is enough to test the data pipeline end to end.\n"};
  std::string s;
  for (size_t i = 0; s.size() < bytes; ++i) s += kLines[(i * 7 + i / 3) % 4];
  return s;
}

}  // namespace

TEST(Utf8, SanitizesInvalidSequences) {
  std::string out;
  EXPECT_EQ(append_sanitized_utf8("plain ascii é ✓ 🙂", out), 0);
  EXPECT_EQ(out, "plain ascii é ✓ 🙂");
  const std::string fffd = "\xEF\xBF\xBD";
  struct Case {
    std::string in, want;
    int64_t n;
  };
  const Case cases[] = {
      {"a\xff"
       "b",
       "a" + fffd + "b", 1},
      {"\xc3", fffd, 1},                                   // truncated 2-byte sequence at the end
      {"\xc3(", fffd + "(", 1},                            // bad continuation
      {"\xe2\x82", fffd, 1},                               // truncated 3-byte: one maximal subpart
      {"\xc0\xaf", fffd + fffd, 2},                        // overlong: both bytes invalid
      {"\xed\xa0\x80", fffd + fffd + fffd, 3},             // UTF-16 surrogate
      {"\xf4\x90\x80\x80", fffd + fffd + fffd + fffd, 4},  // above U+10FFFF
      {"\xf0\x9f\x99", fffd, 1},                           // truncated emoji
      {"\x80\x80", fffd + fffd, 2},                        // stray continuation bytes
  };
  for (const auto& c : cases) {
    std::string o;
    EXPECT_EQ(append_sanitized_utf8(c.in, o), c.n) << c.want;
    EXPECT_EQ(o, c.want);
  }
}

TEST(Corpus, ReadsDirectoryAndSkipsWhatItShould) {
  TempDir d;
  fs::create_directories(d.file("sub"));
  write_file_atomic(d.file("b.txt"), "second file");
  write_file_atomic(d.file("a.txt"), "first file");
  write_file_atomic(d.file("sub/c.txt"), std::string("bad \xff utf8"));
  write_file_atomic(d.file("data.bin"), std::string("bin\0ary", 7));
  write_file_atomic(d.file(".hidden"), "secret");
  fs::create_directories(d.file(".git"));
  write_file_atomic(d.file(".git/config"), "git stuff");
  fs::create_symlink("a.txt", d.file("a.link"));           // sorts before its target
  fs::create_symlink("sub/c.txt", d.file("0first.link"));  // target is in a subdirectory
  fs::create_symlink("sub", d.file("subdir.link"));
  fs::create_symlink("missing.txt", d.file("broken.link"));

  Corpus c = read_corpus(d.path);
  ASSERT_EQ(c.files.size(), 3u);
  EXPECT_EQ(c.files[0], d.file("a.txt"));
  EXPECT_EQ(c.files[1], d.file("b.txt"));
  EXPECT_EQ(c.files[2], d.file("sub/c.txt"));
  EXPECT_EQ(c.text, "first file\nsecond file\nbad \xEF\xBF\xBD utf8");
  EXPECT_EQ(c.replaced_invalid_utf8, 1);
  EXPECT_TRUE(contains(c.skipped, "data.bin (binary")) << ::testing::PrintToString(c.skipped);
  EXPECT_TRUE(contains(c.skipped, ".hidden (hidden)"));
  EXPECT_TRUE(contains(c.skipped, ".git (hidden)"));
  EXPECT_TRUE(contains(c.skipped, "a.link (duplicate"));
  EXPECT_TRUE(contains(c.skipped, "0first.link (duplicate"));
  EXPECT_TRUE(contains(c.skipped, "subdir.link (symlink to a directory"));
  EXPECT_TRUE(contains(c.skipped, "broken.link (broken symlink"));

  // A single file is read as-is.
  Corpus one = read_corpus(d.file("b.txt"));
  EXPECT_EQ(one.text, "second file");
  EXPECT_EQ(one.files.size(), 1u);
}

TEST(Corpus, SymlinkOutsideTreeIsIncluded) {
  TempDir d, other;
  write_file_atomic(other.file("outside.txt"), "from outside");
  fs::create_directories(d.file("c"));
  fs::create_symlink(other.file("outside.txt"), d.file("c/link.txt"));
  Corpus c = read_corpus(d.file("c"));
  EXPECT_EQ(c.text, "from outside");
}

TEST(Corpus, Errors) {
  TempDir d;
  std::string msg = error_of([&] { read_corpus(d.file("missing")); });
  EXPECT_NE(msg.find("missing"), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not exist"), std::string::npos) << msg;

  fs::create_directories(d.file("empty"));
  msg = error_of([&] { read_corpus(d.file("empty")); });
  EXPECT_NE(msg.find("contains no text"), std::string::npos) << msg;

  fs::create_directories(d.file("onlybin"));
  write_file_atomic(d.file("onlybin/x.dat"), std::string("\0\1\2", 3));
  write_file_atomic(d.file("onlybin/empty.txt"), "");
  msg = error_of([&] { read_corpus(d.file("onlybin")); });
  EXPECT_NE(msg.find("contains no text"), std::string::npos) << msg;
  EXPECT_NE(msg.find("x.dat"), std::string::npos) << msg;

  write_file_atomic(d.file("bin.dat"), std::string("\0\1\2", 3));
  msg = error_of([&] { read_corpus(d.file("bin.dat")); });
  EXPECT_NE(msg.find("binary"), std::string::npos) << msg;
}

TEST(Corpus, FortunesDirectoryIfInstalled) {
  const std::string dir = "/usr/share/games/fortunes";
  if (!fs::is_directory(dir)) GTEST_SKIP() << dir << " not installed";
  Corpus c = read_corpus(dir);
  EXPECT_GT(c.text.size(), 100000u);
  for (const auto& f : c.files) {
    EXPECT_EQ(f.find(".dat"), std::string::npos) << f;
    EXPECT_EQ(f.find(".u8"), std::string::npos) << f;
  }
  EXPECT_TRUE(contains(c.skipped, ".dat (binary"));
  EXPECT_TRUE(contains(c.skipped, ".u8 (duplicate"));
}

TEST(Hash, Fnv1aAndSplitmix) {
  // Published FNV-1a 64 test vectors.
  EXPECT_EQ(fnv1a64(""), 0xcbf29ce484222325ULL);
  EXPECT_EQ(fnv1a64("a"), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(fnv1a64("foobar"), 0x85944171f73967e8ULL);
  EXPECT_EQ(fnv1a64("bar", fnv1a64("foo")), fnv1a64("foobar"));
  // splitmix64 reference: first output of the generator seeded with 0.
  EXPECT_EQ(splitmix64(0), 0xe220a8397b1dcdafULL);
}

TEST(TokenCache, RoundTripAndCorruption) {
  TempDir d;
  const std::string p = d.file("tokens.bin");
  std::vector<int32_t> toks;
  for (int i = 0; i < 1000; ++i) toks.push_back((i * 37) % 300);
  write_token_cache(p, toks, 300, 0xabcdef);
  EXPECT_EQ(fs::file_size(p), 48u + 4000u);
  {
    TokenCache tc = TokenCache::open(p, 0xabcdef, 300);
    ASSERT_EQ(tc.size(), 1000);
    EXPECT_EQ(std::vector<int32_t>(tc.data(), tc.data() + tc.size()), toks);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(tc.data()) % 4, 0u);
    TokenCache moved = std::move(tc);
    EXPECT_EQ(moved.data()[5], toks[5]);
    // Tenth hostile pass: the cache was mapped, so a file cut while the run trained killed it
    // (SIGBUS), and one rewritten in place changed the tokens under it. It is read into memory.
    std::vector<int32_t> other(1000, 7);
    write_token_cache(d.file("other.bin"), other, 300, 0xabcdef);
    {
      std::FILE* f = std::fopen(p.c_str(), "r+b");  // in place, as dd conv=notrunc would
      ASSERT_NE(f, nullptr);
      const std::string bytes = attnres::testing::slurp(d.file("other.bin"));
      std::fwrite(bytes.data(), 1, bytes.size(), f);
      std::fclose(f);
    }
    EXPECT_EQ(std::vector<int32_t>(moved.data(), moved.data() + moved.size()), toks);
    fs::resize_file(p, 0);
    EXPECT_EQ(std::vector<int32_t>(moved.data(), moved.data() + moved.size()), toks);
    write_token_cache(p, toks, 300, 0xabcdef);  // (the cases below start from it)
  }
  auto expect_bad = [&](const std::string& bytes, uint64_t key, int32_t vocab,
                        const std::string& needle) {
    const std::string q = d.file("bad.bin");
    write_file_atomic(q, bytes);
    std::string msg = error_of([&] { TokenCache::open(q, key, vocab); });
    EXPECT_NE(msg.find("bad.bin"), std::string::npos) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << "want '" << needle << "' in: " << msg;
  };
  const std::string good = read_file(p);
  expect_bad(good, 0x1234, 300, "key mismatch");
  expect_bad(good, 0xabcdef, 301, "vocab size");
  expect_bad(good.substr(0, 30), 0xabcdef, 300, "truncated");
  expect_bad(good.substr(0, good.size() - 4), 0xabcdef, 300, "wrong size");
  std::string bad_magic = good;
  bad_magic[0] = 'X';
  expect_bad(bad_magic, 0xabcdef, 300, "bad magic");
  std::string bad_version = good;
  bad_version[8] = 1;
  expect_bad(bad_version, 0xabcdef, 300, "version 1");
  std::string bad_token = good;
  int32_t big = 300;
  std::memcpy(bad_token.data() + 48 + 4 * 17, &big, 4);
  expect_bad(bad_token, 0xabcdef, 300, "token id 300 at index 17");
  // Eleventh hostile pass: ids altered inside the vocabulary (zeroed in place between two runs)
  // were trained on and scored as the validation text.
  std::string altered = good;
  std::memset(altered.data() + 48, 0, 400);
  expect_bad(altered, 0xabcdef, 300, "checksum mismatch");
  // A hostile count that would overflow count*4.
  std::string bad_count = good;
  uint64_t huge = ~uint64_t{0} / 2;
  std::memcpy(bad_count.data() + 16, &huge, 8);
  expect_bad(bad_count, 0xabcdef, 300, "wrong size");

  EXPECT_THROW(write_token_cache(d.file("w.bin"), {1, 2, 300}, 300, 1), Error);
  EXPECT_FALSE(fs::exists(d.file("w.bin")));
  // Empty caches are valid.
  write_token_cache(d.file("e.bin"), {}, 256, 9);
  EXPECT_EQ(TokenCache::open(d.file("e.bin"), 9, 256).size(), 0);
}

TEST(TokenSpan, SampleBatchIsDeterministicAndShifted) {
  std::vector<int32_t> toks(1000);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<int32_t>(i);  // value = position
  TokenSpan span(toks.data(), static_cast<int64_t>(toks.size()));
  Batch a, b, c, m;
  span.sample_batch(7, 3, 0, 4, 16, a);
  span.sample_batch(7, 3, 0, 4, 16, b);
  span.sample_batch(7, 4, 0, 4, 16, c);
  span.sample_batch(7, 3, 1, 4, 16, m);
  EXPECT_EQ(a.B, 4);
  EXPECT_EQ(a.T, 16);
  ASSERT_EQ(a.inputs.size(), 64u);
  EXPECT_EQ(a.inputs, b.inputs);
  EXPECT_EQ(a.targets, b.targets);
  EXPECT_NE(a.inputs, c.inputs);
  EXPECT_NE(a.inputs, m.inputs);
  for (int64_t r = 0; r < 4; ++r) {
    for (int64_t t = 0; t < 16; ++t) {
      EXPECT_EQ(a.targets[r * 16 + t], a.inputs[r * 16 + t] + 1);
      if (t > 0) {
        EXPECT_EQ(a.inputs[r * 16 + t], a.inputs[r * 16 + t - 1] + 1);
      }
    }
  }
  // Row r depends only on (seed, step, micro, r): a bigger batch extends a smaller one.
  Batch big;
  span.sample_batch(7, 3, 0, 8, 16, big);
  EXPECT_TRUE(std::equal(a.inputs.begin(), a.inputs.end(), big.inputs.begin()));
  // Data-parallel slices: rows [3, 6) of the batch, alone, are rows 3..5 of the whole batch.
  Batch part;
  span.sample_rows(7, 3, 0, 3, 3, 16, part);
  EXPECT_EQ(part.B, 3);
  ASSERT_EQ(part.inputs.size(), 48u);
  EXPECT_TRUE(std::equal(part.inputs.begin(), part.inputs.end(), big.inputs.begin() + 3 * 16));
  EXPECT_TRUE(std::equal(part.targets.begin(), part.targets.end(), big.targets.begin() + 3 * 16));
  span.sample_rows(7, 3, 0, 0, 3, 16, part);
  EXPECT_FALSE(std::equal(part.inputs.begin(), part.inputs.end(), big.inputs.begin() + 3 * 16));

  // Start offsets cover [0, n-T-1] including both ends, and never run past the end.
  TokenSpan small(toks.data(), 20);
  std::set<int32_t> starts;
  Batch s;
  for (int step = 0; step < 400; ++step) {
    small.sample_batch(1, step, 0, 2, 16, s);
    for (int r = 0; r < 2; ++r) {
      starts.insert(s.inputs[r * 16]);
      EXPECT_LE(s.targets[r * 16 + 15], 19);
    }
  }
  EXPECT_EQ(starts, (std::set<int32_t>{0, 1, 2, 3}));

  std::string msg = error_of([&] { TokenSpan(toks.data(), 16).sample_batch(1, 0, 0, 1, 16, s); });
  EXPECT_NE(msg.find("split has 16 tokens, fewer than seq_len+1 = 17"), std::string::npos) << msg;
  EXPECT_NO_THROW(TokenSpan(toks.data(), 17).sample_batch(1, 0, 0, 1, 16, s));
}

TEST(TokenSpan, WindowBatchCoversSplit) {
  std::vector<int32_t> toks(103);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<int32_t>(i);
  TokenSpan span(toks.data(), 103);
  const int64_t T = 10;
  EXPECT_EQ(span.num_windows(T), 10);  // windows start at 0,10,..,90; the last ends at token 100
  EXPECT_EQ(TokenSpan(toks.data(), 11).num_windows(T), 1);
  EXPECT_EQ(TokenSpan(toks.data(), 10).num_windows(T), 0);
  EXPECT_EQ(TokenSpan(toks.data(), 21).num_windows(T), 2);
  EXPECT_EQ(TokenSpan(toks.data(), 20).num_windows(T), 1);

  std::vector<int> target_seen(103, 0);
  Batch b;
  const int64_t nw = span.num_windows(T), B = 3;
  for (int64_t w = 0; w < nw; w += B) {
    span.window_batch(w, B, T, b);
    for (int64_t r = 0; r < B; ++r) {
      const int64_t win = (w + r) % nw;
      EXPECT_EQ(b.inputs[r * T], win * T);
      for (int64_t t = 0; t < T; ++t) EXPECT_EQ(b.targets[r * T + t], b.inputs[r * T + t] + 1);
      if (w + r < nw) {
        for (int64_t t = 0; t < T; ++t) target_seen[b.targets[r * T + t]]++;
      }
    }
  }
  // Every target 1..100 is scored exactly once; nothing past the last full window.
  for (int i = 1; i <= 100; ++i) EXPECT_EQ(target_seen[i], 1) << i;
  EXPECT_EQ(target_seen[0] + target_seen[101] + target_seen[102], 0);
  EXPECT_THROW(TokenSpan(toks.data(), 5).window_batch(0, 1, T, b), Error);
}

TEST(PrepareData, ByteEndToEndAndCacheReuse) {
  TempDir d;
  fs::create_directories(d.file("corpus"));
  const std::string text = sample_text(20000);
  write_file_atomic(d.file("corpus/a.txt"), text);
  DataOptions opt;
  opt.corpus_path = d.file("corpus");
  opt.tokenizer = TokenizerKind::byte;
  opt.out_dir = d.file("out");
  opt.val_fraction = 0.1;

  PreparedData p = prepare_data(opt);
  EXPECT_EQ(p.tokenizer_ref, "byte");
  EXPECT_FALSE(p.cache_reused);
  EXPECT_FALSE(p.tokenizer_trained);
  EXPECT_EQ(p.corpus_bytes, static_cast<int64_t>(text.size()));
  EXPECT_EQ(p.train.size() + p.val.size(), static_cast<int64_t>(text.size()));
  EXPECT_EQ(p.train.size(), static_cast<int64_t>(text.size() * 9 / 10));
  EXPECT_EQ(p.train.data()[0], static_cast<unsigned char>(text[0]));
  EXPECT_EQ(p.val.data()[0], static_cast<unsigned char>(text[p.train.size()]));
  EXPECT_TRUE(fs::exists(d.file("out/tokens.bin")));

  PreparedData q = prepare_data(opt);
  EXPECT_TRUE(q.cache_reused);
  EXPECT_EQ(q.train.size(), p.train.size());

  // Moving PreparedData keeps the spans valid (the mapping does not move).
  PreparedData moved = std::move(q);
  Batch b;
  moved.train.sample_batch(1, 0, 0, 2, 32, b);
  EXPECT_EQ(b.inputs.size(), 64u);

  // Changing the corpus invalidates the cache.
  write_file_atomic(d.file("corpus/b.txt"), "more text here\n");
  PreparedData r = prepare_data(opt);
  EXPECT_FALSE(r.cache_reused);
  EXPECT_EQ(r.files.size(), 2u);

  // A corrupt cache is rebuilt rather than trusted.
  write_file_atomic(d.file("out/tokens.bin"), "ARTOKCCH garbage");
  PreparedData s = prepare_data(opt);
  EXPECT_FALSE(s.cache_reused);
  EXPECT_EQ(s.train.size() + s.val.size(), r.train.size() + r.val.size());
  // A file that is no token cache at all is the user's: refused, never replaced (eleventh
  // hostile pass).
  write_file_atomic(d.file("out/tokens.bin"), "my own tokens");
  EXPECT_NE(error_of([&] { prepare_data(opt); }).find("is not a token cache"), std::string::npos);
  EXPECT_EQ(read_file(d.file("out/tokens.bin")), "my own tokens");
}

TEST(PrepareData, BpeTrainsOnceAndReuses) {
  TempDir d;
  const std::string text = sample_text(30000);
  write_file_atomic(d.file("corpus.txt"), text);
  DataOptions opt;
  opt.corpus_path = d.file("corpus.txt");
  opt.tokenizer = TokenizerKind::bpe;
  opt.vocab_size = 400;
  opt.out_dir = d.file("out");

  PreparedData p = prepare_data(opt);
  EXPECT_TRUE(p.tokenizer_trained);
  EXPECT_FALSE(p.cache_reused);
  EXPECT_EQ(p.tokenizer_ref, "sentencepiece:tokenizer.model");
  EXPECT_EQ(p.tokenizer_path, d.file("out/tokenizer.model"));
  EXPECT_EQ(p.tokenizer->vocab_size(), 400);
  const int64_t n = p.train.size() + p.val.size();
  EXPECT_LT(n, static_cast<int64_t>(text.size()) / 2);  // BPE compresses
  std::vector<int32_t> all(p.train.data(), p.train.data() + n);
  EXPECT_EQ(p.tokenizer->decode(all), text);

  const auto mtime = fs::last_write_time(d.file("out/tokenizer.model"));
  PreparedData q = prepare_data(opt);
  EXPECT_FALSE(q.tokenizer_trained);
  EXPECT_TRUE(q.cache_reused);
  EXPECT_EQ(fs::last_write_time(d.file("out/tokenizer.model")), mtime);
  EXPECT_EQ(q.train.size(), p.train.size());

  // The checkpoint reference resolves to the same tokenizer.
  auto tok = load_tokenizer(q.tokenizer_ref, opt.out_dir);
  EXPECT_EQ(tok->encode("The model learns."), q.tokenizer->encode("The model learns."));

  // A different vocab size retrains.
  opt.vocab_size = 420;
  PreparedData r = prepare_data(opt);
  EXPECT_TRUE(r.tokenizer_trained);
  EXPECT_FALSE(r.cache_reused);
  EXPECT_EQ(r.tokenizer->vocab_size(), 420);
}

// Fourteenth hostile pass (found in the thirteenth): a tokenizer.model edited in a run stopped
// before its first checkpoint was reused (the key named only the corpus and vocabulary), and a
// user's tokenizer.model where a run keeps its own (compare's OUT/data) was trained over.
TEST(PrepareData, TheTokenizerFileIsOursAndAsTrained) {
  using attnres::testing::slurp;
  TempDir d;
  write_file_atomic(d.file("corpus.txt"), sample_text(20000));
  DataOptions opt;
  opt.corpus_path = d.file("corpus.txt");
  opt.tokenizer = TokenizerKind::bpe;
  opt.vocab_size = 400;
  opt.out_dir = d.file("out");
  const PreparedData p = prepare_data(opt);
  const std::string trained = slurp(d.file("out/tokenizer.model"));
  // Another valid SentencePiece model put in its place (one of another vocabulary) is retrained.
  DataOptions other = opt;
  other.vocab_size = 300;
  other.out_dir = d.file("other");
  prepare_data(other);
  write_file_atomic(d.file("out/tokenizer.model"), slurp(d.file("other/tokenizer.model")));
  const PreparedData q = prepare_data(opt);
  EXPECT_TRUE(q.tokenizer_trained);
  EXPECT_EQ(q.tokenizer->vocab_size(), 400);
  EXPECT_EQ(q.tokenizer_fingerprint, p.tokenizer_fingerprint);
  EXPECT_EQ(slurp(d.file("out/tokenizer.model")), trained);
  // A key of the format before the checksum is trusted only where a fingerprint is checked.
  const std::string key = slurp(d.file("out/tokenizer.model.trainkey"));
  ASSERT_NE(key.rfind(':'), std::string::npos);
  write_file_atomic(d.file("out/tokenizer.model.trainkey"), key.substr(0, key.rfind(':')));
  DataOptions resume = opt;
  resume.expect_tokenizer_fingerprint = p.tokenizer_fingerprint;
  EXPECT_FALSE(prepare_data(resume).tokenizer_trained);
  EXPECT_TRUE(prepare_data(opt).tokenizer_trained);
  // A tokenizer.model with no key beside it is not replaced, whether trained or given.
  const std::string mine = slurp(d.file("other/tokenizer.model"));
  fs::create_directories(d.file("user"));
  write_file_atomic(d.file("user/tokenizer.model"), mine);
  DataOptions user = opt;
  user.out_dir = d.file("user");
  const std::string msg = error_of([&] { prepare_data(user); });
  EXPECT_NE(msg.find("was not prepared by attnres"), std::string::npos) << msg;
  user.tokenizer_model = d.file("out/tokenizer.model");
  EXPECT_NE(error_of([&] { prepare_data(user); }).find("was not prepared by attnres"),
            std::string::npos);
  EXPECT_EQ(slurp(d.file("user/tokenizer.model")), mine);
  // Given as --tokenizer-model itself, it is used where it is.
  user.tokenizer_model = d.file("user/tokenizer.model");
  EXPECT_EQ(prepare_data(user).tokenizer->vocab_size(), 300);
  // A key left by a kill during training makes the file ours: it is trained again.
  write_file_atomic(d.file("out/tokenizer.model.trainkey"), "training");
  write_file_atomic(d.file("out/tokenizer.model"), "half a model");
  EXPECT_TRUE(prepare_data(opt).tokenizer_trained);
  EXPECT_EQ(slurp(d.file("out/tokenizer.model")), trained);
}

TEST(PrepareData, OutputDirInsideCorpusIsNotRead) {
  TempDir d;
  fs::create_directories(d.file("corpus"));
  write_file_atomic(d.file("corpus/a.txt"), sample_text(20000));
  DataOptions opt;
  opt.corpus_path = d.file("corpus");
  opt.tokenizer = TokenizerKind::bpe;
  opt.vocab_size = 400;
  opt.out_dir = d.file("corpus/run");
  PreparedData p = prepare_data(opt);
  EXPECT_TRUE(p.tokenizer_trained);
  EXPECT_EQ(p.files.size(), 1u);
  PreparedData q = prepare_data(opt);  // the model and key files must not change the corpus
  EXPECT_FALSE(q.tokenizer_trained);
  EXPECT_TRUE(q.cache_reused);
  EXPECT_TRUE(contains(q.skipped, "run (output directory"));
  // Issue 19: another run's directory in the corpus (its log and configuration are text) is not
  // read either; a directory that only looks like one in part is.
  fs::create_directories(d.file("corpus/old/checkpoints"));
  write_file_atomic(d.file("corpus/old/train_config.json"), "{\"steps\": 5}\n");
  write_file_atomic(d.file("corpus/old/notes.txt"), "run notes\n");
  fs::create_directories(d.file("corpus/texts"));
  write_file_atomic(d.file("corpus/texts/train_config.json"), "not a run\n");
  const PreparedData r = prepare_data(opt);
  EXPECT_TRUE(contains(r.skipped, "old (an attnres run directory, excluded)"));
  EXPECT_EQ(r.files.size(), 2u);  // a.txt and texts/train_config.json
  EXPECT_NE(r.fingerprint, q.fingerprint);
  // Fourth hostile pass: a comparison directory in the corpus is not read either; the run's own
  // directory as the corpus (--data D --out D: a run that could never be resumed) and a run's
  // directory as the corpus are refused.
  fs::create_directories(d.file("corpus/cmp/runs"));
  write_file_atomic(d.file("corpus/cmp/results.json"), "{}\n");
  EXPECT_TRUE(contains(prepare_data(opt).skipped, "cmp (an attnres comparison directory"));
  DataOptions same = opt;
  same.out_dir = d.file("corpus");
  try {
    prepare_data(same);
    ADD_FAILURE() << "--data D --out D was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is the run's output directory (--out)"),
              std::string::npos)
        << e.what();
  }
  DataOptions run_as_corpus = opt;
  run_as_corpus.corpus_path = d.file("corpus/old");
  run_as_corpus.out_dir = d.file("elsewhere");
  try {
    prepare_data(run_as_corpus);
    ADD_FAILURE() << "a run directory was read as a corpus";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is an attnres run directory, not text"),
              std::string::npos)
        << e.what();
  }
}

// Issue 19: a resumed run's tokenizer must be the one it trained with (another tokenizer.model
// of the same vocabulary was loaded and the tokens rebuilt with it), and a model's tokenizer must
// have its vocabulary (generate and inspect decoded with another run's file).
TEST(PrepareData, TheRunsTokenizerOnly) {
  TempDir d;
  write_file_atomic(d.file("a.txt"), sample_text(20000));
  DataOptions opt;
  opt.corpus_path = d.file("a.txt");
  opt.tokenizer = TokenizerKind::bpe;
  opt.vocab_size = 400;
  opt.out_dir = d.file("run");
  const PreparedData p = prepare_data(opt);
  opt.expect_tokenizer_fingerprint = p.tokenizer_fingerprint;
  EXPECT_NO_THROW(prepare_data(opt));
  opt.expect_tokenizer_fingerprint = "0123456789abcdef";
  const std::string msg = error_of([&] { prepare_data(opt); });
  EXPECT_NE(msg.find("is not the one this run was trained with"), std::string::npos) << msg;
  EXPECT_NO_THROW(load_tokenizer("sentencepiece:tokenizer.model", d.file("run"), 400));
  const std::string v = error_of([&] { load_tokenizer("byte", d.file("run"), 400); });
  EXPECT_NE(v.find("has a vocabulary of 256, the model's is 400"), std::string::npos) << v;
}

TEST(PrepareData, Errors) {
  TempDir d;
  write_file_atomic(d.file("tiny.txt"), "abc");
  DataOptions opt;
  opt.corpus_path = d.file("tiny.txt");
  opt.out_dir = d.file("out");
  std::string msg = error_of([&] { prepare_data(opt); });
  EXPECT_NE(msg.find("at least 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tiny.txt"), std::string::npos) << msg;

  write_file_atomic(d.file("ok.txt"), sample_text(1000));
  opt.corpus_path = d.file("ok.txt");
  EXPECT_NE(error_of([&] { parse_tokenizer_kind("wordpiece"); }).find("use byte or bpe"),
            std::string::npos);
  opt.val_fraction = 0.0;
  EXPECT_NE(error_of([&] { prepare_data(opt); }).find("between 0 and 1"), std::string::npos);
  opt.val_fraction = 0.1;
  opt.out_dir = "";
  EXPECT_THROW(prepare_data(opt), Error);
  opt.out_dir = d.file("out");
  opt.corpus_path = d.file("nope");
  EXPECT_NE(error_of([&] { prepare_data(opt); }).find("does not exist"), std::string::npos);
}
