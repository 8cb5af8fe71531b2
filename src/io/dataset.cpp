// dataset.cpp — batch sampling over token spans and the prepare_data pipeline.
#include <omp.h>

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "attnres/data.hpp"
#include "attnres/error.hpp"
#include "core/parallel.hpp"
#include "core/rng.hpp"

namespace attnres {

// ---------------------------------------------------------------------------------------------
// TokenSpan

TokenSpan::TokenSpan(const int32_t* data, int64_t n) : data_(data), n_(n) {
  check(n >= 0 && (n == 0 || data != nullptr), "internal: TokenSpan with invalid data/size");
}

void TokenSpan::check_fits(int64_t B, int64_t T) const {
  check(B > 0 && T > 0, "batch size and sequence length must be positive (got B=" +
                            std::to_string(B) + ", T=" + std::to_string(T) + ")");
  check(n_ >= T + 1, "split has " + std::to_string(n_) + " tokens, fewer than seq_len+1 = " +
                         std::to_string(T + 1) + "; use a larger corpus or a smaller --seq-len");
}

void TokenSpan::sample_batch(uint64_t seed, int64_t step, int64_t micro, int64_t B, int64_t T,
                             Batch& out) const {
  sample_rows(seed, step, micro, 0, B, T, out);
}

void TokenSpan::sample_rows(uint64_t seed, int64_t step, int64_t micro, int64_t first_row,
                            int64_t B, int64_t T, Batch& out) const {
  check_fits(B, T);
  check(first_row >= 0, "internal: negative first batch row " + std::to_string(first_row));
  out.B = B;
  out.T = T;
  out.inputs.resize(static_cast<size_t>(B * T));
  out.targets.resize(static_cast<size_t>(B * T));
  // Starts in [0, n-T-1]: n-T possible offsets. The modulo bias is below (n-T)/2^64.
  const uint64_t range = static_cast<uint64_t>(n_ - T);
  const uint64_t base = splitmix64(splitmix64(splitmix64(seed) ^ static_cast<uint64_t>(step)) ^
                                   static_cast<uint64_t>(micro));
  for (int64_t r = 0; r < B; ++r) {
    const uint64_t h = splitmix64(base ^ static_cast<uint64_t>(first_row + r));
    const int32_t* src = data_ + (h % range);
    int32_t* in = out.inputs.data() + r * T;
    int32_t* tg = out.targets.data() + r * T;
    for (int64_t t = 0; t < T; ++t) {
      in[t] = src[t];
      tg[t] = src[t + 1];
    }
  }
}

int64_t TokenSpan::num_windows(int64_t T) const {
  check(T > 0, "sequence length must be positive (got " + std::to_string(T) + ")");
  return n_ >= T + 1 ? (n_ - 1) / T : 0;
}

void TokenSpan::window_batch(int64_t first_window, int64_t B, int64_t T, Batch& out) const {
  check_fits(B, T);
  check(first_window >= 0, "window index must be non-negative");
  const int64_t nw = num_windows(T);
  out.B = B;
  out.T = T;
  out.inputs.resize(static_cast<size_t>(B * T));
  out.targets.resize(static_cast<size_t>(B * T));
  for (int64_t r = 0; r < B; ++r) {
    const int32_t* src = data_ + ((first_window + r) % nw) * T;
    int32_t* in = out.inputs.data() + r * T;
    int32_t* tg = out.targets.data() + r * T;
    for (int64_t t = 0; t < T; ++t) {
      in[t] = src[t];
      tg[t] = src[t + 1];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Parallel encoding

std::vector<int32_t> encode_parallel(const Tokenizer& tok, std::string_view text,
                                     size_t min_chunk_bytes) {
  // Cut points just after a '\n', roughly every `chunk` bytes; a line longer than the chunk size
  // simply makes its chunk longer, which keeps the result identical to a single encode().
  const size_t threads = static_cast<size_t>(std::max(1, omp_get_max_threads()));
  size_t chunk = std::max<size_t>(min_chunk_bytes, text.size() / (threads * 4) + 1);
  std::vector<size_t> cuts{0};
  while (cuts.back() < text.size()) {
    size_t target = cuts.back() + chunk;
    if (target >= text.size()) {
      cuts.push_back(text.size());
      break;
    }
    size_t nl = text.find('\n', target);
    cuts.push_back(nl == std::string_view::npos ? text.size() : nl + 1);
  }
  const int64_t nchunks = static_cast<int64_t>(cuts.size()) - 1;
  if (nchunks <= 1) return tok.encode(text);

  std::vector<std::vector<int32_t>> parts(static_cast<size_t>(nchunks));
  RegionErrors errors;  // (an exception must not leave the region)
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < nchunks; ++i) {
    errors.run([&] { parts[i] = tok.encode(text.substr(cuts[i], cuts[i + 1] - cuts[i])); });
  }
  errors.rethrow();
  size_t total = 0;
  for (const auto& p : parts) total += p.size();
  std::vector<int32_t> out;
  out.reserve(total);
  for (auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// ---------------------------------------------------------------------------------------------
// prepare_data

namespace {

// Reads a small text file, returning "" if it does not exist or cannot be read.
// (max_bytes > 0: a file larger than that is not the small file expected: "")
std::string read_if_exists(const std::string& path, size_t max_bytes = 0) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return {};
  try {
    return max_bytes ? read_small_file(path, max_bytes, "it") : read_file(path);
  } catch (const Error&) {
    return {};
  }
}

}  // namespace

PreparedData prepare_data(const DataOptions& opt) {
  check(!opt.out_dir.empty(),
        "data preparation needs an output directory for the tokenizer and token cache");
  check(opt.val_fraction > 0.0 && opt.val_fraction < 1.0,
        "validation fraction " + std::to_string(opt.val_fraction) +
            " must be strictly between 0 and 1 (e.g. 0.1)");
  std::error_code ec;
  std::filesystem::create_directories(opt.out_dir, ec);
  check(!ec && std::filesystem::is_directory(opt.out_dir), "cannot create output directory '" +
                                                               opt.out_dir + "': " + ec.message() +
                                                               "; choose a writable location");

  PreparedData pd;
  Corpus corpus = read_corpus(opt.corpus_path, opt.out_dir);
  pd.files = std::move(corpus.files);
  pd.skipped = std::move(corpus.skipped);
  pd.corpus_bytes = static_cast<int64_t>(corpus.text.size());
  pd.replaced_invalid_utf8 = corpus.replaced_invalid_utf8;
  const uint64_t text_hash = fnv1a64(corpus.text);
  pd.fingerprint = hex64(text_hash);
  check(opt.expect_fingerprint.empty() || opt.expect_fingerprint == pd.fingerprint,
        "the corpus '" + opt.corpus_path + "' (" + std::to_string(pd.corpus_bytes) + " bytes in " +
            std::to_string(pd.files.size()) +
            " file(s)) is not the text this run was trained on: it changed since the run "
            "started. Resuming would train on other data (and retrain a BPE tokenizer under the "
            "trained weights). Restore the corpus, or start a new run from these weights: "
            "attnres train --init-from <run>/checkpoints/<step>/model.safetensors --data ...");

  if (opt.tokenizer == TokenizerKind::byte) {
    pd.tokenizer = make_byte_tokenizer();
  } else {
    const std::string model_path = join_path(opt.out_dir, "tokenizer.model");
    const std::string key_path = model_path + ".trainkey";
    // Identifies what the model was trained from; bump "v1" if training settings change.
    const std::string train_key =
        hex64(fnv1a64("spm-bpe-v1:vocab=" + std::to_string(opt.vocab_size), text_hash));
    const std::string key = read_if_exists(key_path, 4096);
    // A tokenizer.model with no key beside it was not prepared here (a user's, an import's): it
    // is never replaced. (A key is written before training starts, so a kill mid-training leaves
    // a file that is still ours.)
    auto check_replaceable = [&] {
      check(
          !std::filesystem::exists(std::filesystem::symlink_status(model_path, ec)) || !key.empty(),
          "'" + model_path + "' was not prepared by attnres (no '" + key_path +
              "' beside it), and a run keeps its tokenizer under that name: it is left alone; "
              "move it away, pass it as --tokenizer-model, or use another --out");
    };
    if (!opt.tokenizer_model.empty()) {
      // A given model: checked, then copied in (its key says it was not trained on this corpus).
      const std::string given = read_small_file(opt.tokenizer_model, kMaxSentencePieceBytes,
                                                "a SentencePiece tokenizer model");
      load_sentencepiece(opt.tokenizer_model);
      if (read_if_exists(model_path) != given) {
        check_replaceable();
        write_file_atomic(model_path, given);
      }
      write_file_atomic(key_path, "given:" + hex64(fnv1a64(given)));
      pd.tokenizer = load_sentencepiece(model_path);
    } else if (key.rfind(train_key, 0) == 0) {
      try {
        pd.tokenizer = load_sentencepiece(model_path);
      } catch (const Error&) {
        pd.tokenizer.reset();  // corrupt: retrain below
      }
      // The key ends with the model's own checksum: a model edited since is retrained. (A key
      // without it, from before: only a resume, whose fingerprint check follows, trusts it.)
      const std::string stamped =
          pd.tokenizer ? train_key + ":" + hex64(fnv1a64(pd.tokenizer->model_data())) : "";
      if (key != stamped && !(key == train_key && !opt.expect_tokenizer_fingerprint.empty())) {
        pd.tokenizer.reset();
      }
    }
    if (!pd.tokenizer) {
      check_replaceable();
      write_file_atomic(key_path, "training");
      train_sentencepiece(corpus.text, opt.vocab_size, model_path);
      pd.tokenizer = load_sentencepiece(model_path);
      write_file_atomic(key_path, train_key + ":" + hex64(fnv1a64(pd.tokenizer->model_data())));
      pd.tokenizer_trained = true;
    }
    pd.tokenizer_path = model_path;
  }
  pd.tokenizer_ref = pd.tokenizer->ref();
  pd.tokenizer_fingerprint = hex64(fnv1a64(pd.tokenizer->model_data()));
  check(opt.expect_tokenizer_fingerprint.empty() ||
            opt.expect_tokenizer_fingerprint == pd.tokenizer_fingerprint,
        "the tokenizer '" + (pd.tokenizer_path.empty() ? pd.tokenizer_ref : pd.tokenizer_path) +
            "' is not the one this run was trained with (it was replaced or retrained): "
            "resuming would read the text as other tokens. Restore it from the checkpoint "
            "(each checkpoints/step_N/ holds a copy), or start a new run");
  const int32_t vocab = pd.tokenizer->vocab_size();
  const uint64_t key = fnv1a64(pd.tokenizer->model_data(), fnv1a64(pd.tokenizer_ref, text_hash));

  const std::string cache_path = join_path(opt.out_dir, "tokens.bin");
  if (std::filesystem::exists(std::filesystem::symlink_status(cache_path, ec))) {
    check(is_token_cache_file(cache_path),
          "'" + cache_path +
              "' is not a token cache, and a run keeps its tokens under that name: it is left "
              "alone; move it away, or use another --out");
    try {
      pd.tokens = TokenCache::open(cache_path, key, vocab);
      pd.cache_reused = true;
    } catch (const Error&) {
      pd.cache_reused = false;  // stale (other corpus/tokenizer) or corrupt: rebuild below
    }
  }
  if (!pd.cache_reused) {
    std::vector<int32_t> tokens = encode_parallel(*pd.tokenizer, corpus.text);
    write_token_cache(cache_path, tokens, vocab, key);
    pd.tokens = TokenCache::open(cache_path, key, vocab);
  }

  const int64_t n = pd.tokens.size();
  const int64_t n_train =
      static_cast<int64_t>(std::floor(static_cast<double>(n) * (1.0 - opt.val_fraction)));
  const int64_t n_val = n - n_train;
  check(n_train >= 2 && n_val >= 2,
        "corpus '" + opt.corpus_path + "' gives only " + std::to_string(n) +
            " tokens: " + std::to_string(n_train) + " for training and " + std::to_string(n_val) +
            " for validation, and each split needs at least 2; use a larger corpus or adjust "
            "the validation fraction");
  pd.train = TokenSpan(pd.tokens.data(), n_train);
  pd.val = TokenSpan(pd.tokens.data() + n_train, n_val);
  return pd;
}

}  // namespace attnres
