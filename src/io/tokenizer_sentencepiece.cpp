// tokenizer_sentencepiece.cpp — SentencePiece BPE training and loading.
//
// Training settings are chosen for exact round trips and reproducibility rather than for
// SentencePiece's defaults: identity normalisation, no whitespace collapsing and no dummy "▁"
// prefix (so decode(encode(s)) == s for any UTF-8 s without U+2581), byte fallback (so any text
// encodes without <unk>), no BOS/EOS, and no random sampling or shuffling of sentences.
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/tokenizer.hpp"

// Exported by libsentencepiece but not declared in its public headers; used to silence the
// trainer's LOG(INFO) chatter, since library code must not print.
namespace sentencepiece::logging {
int GetMinLogLevel();
void SetMinLogLevel(int v);
}  // namespace sentencepiece::logging

namespace attnres {

namespace {

constexpr size_t kMaxSentenceBytes = 2048;        // well under SentencePiece's 4192-byte limit
constexpr size_t kMaxTrainSentences = 2'000'000;  // caps trainer memory/time on huge corpora

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(std::string model, std::string file_name)
      : model_(std::move(model)), file_name_(std::move(file_name)) {}

  sentencepiece::SentencePieceProcessor& sp() { return sp_; }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    auto st = sp_.Encode(absl::string_view(text.data(), text.size()), &ids);
    check(st.ok(),
          "sentencepiece tokenizer '" + file_name_ + "' failed to encode text: " + st.ToString());
    return std::vector<int32_t>(ids.begin(), ids.end());
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    const int32_t n = vocab_size();
    for (size_t i = 0; i < ids.size(); ++i) {
      check(ids[i] >= 0 && ids[i] < n,
            "sentencepiece tokenizer '" + file_name_ + "' cannot decode id " +
                std::to_string(ids[i]) + " at position " + std::to_string(i) + " (vocab size " +
                std::to_string(n) + "); the ids come from another tokenizer or model");
    }
    std::string out;
    auto st = sp_.Decode(std::vector<int>(ids.begin(), ids.end()), &out);
    check(st.ok(),
          "sentencepiece tokenizer '" + file_name_ + "' failed to decode: " + st.ToString());
    return out;
  }

  int32_t vocab_size() const override { return static_cast<int32_t>(sp_.GetPieceSize()); }
  std::string ref() const override { return "sentencepiece:" + file_name_; }
  std::string model_data() const override { return model_; }

 private:
  sentencepiece::SentencePieceProcessor sp_;
  std::string model_;
  std::string file_name_;
};

// Feeds pre-split sentences to the trainer without copying the whole corpus again.
class ViewIterator final : public sentencepiece::SentenceIterator {
 public:
  explicit ViewIterator(const std::vector<std::string_view>* s) : s_(s) { load(); }
  bool done() const override { return i_ >= s_->size(); }
  void Next() override {
    ++i_;
    load();
  }
  const std::string& value() const override { return cur_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  void load() {
    if (i_ < s_->size()) cur_.assign((*s_)[i_].data(), (*s_)[i_].size());
  }
  const std::vector<std::string_view>* s_;
  size_t i_ = 0;
  std::string cur_;
};

// Number of bytes of the UTF-8 sequence starting with lead byte c (1 for stray bytes).
size_t utf8_len(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c & 0xe0) == 0xc0) return 2;
  if ((c & 0xf0) == 0xe0) return 3;
  if ((c & 0xf8) == 0xf0) return 4;
  return 1;
}

// Splits text into training sentences: one per line, long lines cut at a space (or else a UTF-8
// character boundary) so no sentence exceeds kMaxSentenceBytes and the trainer drops nothing.
std::vector<std::string_view> split_sentences(std::string_view text) {
  std::vector<std::string_view> out;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string_view::npos) nl = text.size();
    std::string_view line = text.substr(pos, nl - pos);
    pos = nl + 1;
    while (line.size() > kMaxSentenceBytes) {
      size_t cut = line.rfind(' ', kMaxSentenceBytes);
      if (cut == std::string_view::npos || cut < kMaxSentenceBytes / 2) {
        cut = 0;
        while (cut < line.size()) {
          size_t l = utf8_len(static_cast<unsigned char>(line[cut]));
          if (cut + l > kMaxSentenceBytes) break;
          cut += l;
        }
        if (cut == 0) cut = 1;
      }
      out.push_back(line.substr(0, cut));
      line = line.substr(cut);
    }
    if (!line.empty()) out.push_back(line);
  }
  if (out.size() > kMaxTrainSentences) {
    // Evenly spaced deterministic subsample, so the whole corpus is represented.
    std::vector<std::string_view> sub;
    sub.reserve(kMaxTrainSentences);
    for (size_t k = 0; k < kMaxTrainSentences; ++k) {
      // k * size fits in 64 bits: both factors are far below 2^32 for any in-memory corpus.
      sub.push_back(out[static_cast<size_t>(uint64_t{k} * out.size() / kMaxTrainSentences)]);
    }
    out.swap(sub);
  }
  return out;
}

std::mutex& sp_global_mutex() {
  static std::mutex mu;
  return mu;
}

// Holds SentencePiece's process-global state (log level, RNG seed) for one call and restores the
// log level afterwards, even on exceptions.
struct QuietLogs {
  std::lock_guard<std::mutex> lock{sp_global_mutex()};
  int saved;
  QuietLogs() : saved(sentencepiece::logging::GetMinLogLevel()) {
    sentencepiece::logging::SetMinLogLevel(3);
  }
  ~QuietLogs() { sentencepiece::logging::SetMinLogLevel(saved); }
};

// Extracts the first integer after `key` in msg (for rewording SentencePiece errors); -1 if none.
long long number_after(const std::string& msg, const std::string& key) {
  size_t p = msg.find(key);
  if (p == std::string::npos) return -1;
  p += key.size();
  while (p < msg.size() && !(msg[p] >= '0' && msg[p] <= '9')) ++p;
  if (p >= msg.size()) return -1;
  return std::stoll(msg.substr(p, 18));
}

// SentencePiece's trainer runs its work on threads of its own; an exception there (std::bad_alloc
// under `ulimit -v`) cannot be caught and aborted the whole process. So it trains in a child
// process: the child sends back 'M' + the serialized model or 'E' + the trainer's status, and a
// child that dies (of SIGABRT, or is killed) becomes an Error here.
struct TrainOutcome {
  bool ok = false;
  std::string payload;  // the model, or the status message
};

TrainOutcome train_in_child(const std::function<sentencepiece::util::Status(std::string*)>& fn) {
  int fds[2];
  check(::pipe2(fds, O_CLOEXEC) == 0,
        "cannot train the BPE tokenizer: pipe failed: " + errno_text(errno));
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int err = errno;
    ::close(fds[0]);
    ::close(fds[1]);
    throw Error("cannot train the BPE tokenizer: fork failed (" + errno_text(err) +
                "); the process is out of memory or processes (ulimit -v / -u)");
  }
  if (pid == 0) {  // the child: no output of its own (an abort message would be noise)
    // It dies with its parent: a killed `train` left it training for minutes, its CPU and the
    // run's lock held (seventeenth hostile pass). (The parent may be gone already.)
    ::prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    if (::getppid() != parent) ::_exit(3);
    ::close(fds[0]);
    const int null = ::open("/dev/null", O_WRONLY);
    if (null >= 0) ::dup2(null, 2);
    std::string out;
    try {
      std::string model;
      const sentencepiece::util::Status st = fn(&model);
      out = st.ok() ? "M" + model : "E" + st.ToString();
    } catch (const std::exception& e) {
      out = std::string("E") + e.what();
    }
    size_t done = 0;
    while (done < out.size()) {
      const ssize_t n = ::write(fds[1], out.data() + done, out.size() - done);
      if (n <= 0 && errno != EINTR) ::_exit(3);
      if (n > 0) done += static_cast<size_t>(n);
    }
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string got;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n > 0) {
      got.append(buf, static_cast<size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  const bool exited_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (!exited_ok || got.empty()) {
    const std::string how = WIFSIGNALED(status)
                                ? "was killed by signal " + std::to_string(WTERMSIG(status)) +
                                      (WTERMSIG(status) == SIGABRT
                                           ? " (SIGABRT: almost always out of memory, e.g. under "
                                             "ulimit -v)"
                                           : std::string())
                                : "exited with status " + std::to_string(WEXITSTATUS(status));
    const bool abort = WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
    throw Error(std::string(abort ? "out of memory: " : "") +
                "training the BPE tokenizer failed: its process " + how +
                "; raise the memory limit, or use a smaller corpus or --vocab-size, or "
                "--tokenizer byte");
  }
  return {got[0] == 'M', got.substr(1)};
}

}  // namespace

void train_sentencepiece(const std::string& text, int vocab_size, const std::string& model_path) {
  check(vocab_size >= kMinSentencepieceVocab,
        "BPE vocab size " + std::to_string(vocab_size) +
            " is too small: byte fallback alone "
            "needs 256 byte pieces plus <unk>; use --vocab-size " +
            std::to_string(kMinSentencepieceVocab) + " or more (e.g. 4096)");
  check(vocab_size <= (1 << 24), "BPE vocab size " + std::to_string(vocab_size) +
                                     " is unreasonably large; use --vocab-size <= 16777216");
  std::vector<std::string_view> sentences = split_sentences(text);
  check(!sentences.empty(), "cannot train a BPE tokenizer for '" + model_path +
                                "': the training text has no non-empty lines; give a corpus "
                                "with text in it");

  unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const std::unordered_map<std::string, std::string> kwargs = {
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(vocab_size)},
      {"byte_fallback", "true"},
      {"character_coverage", "0.9995"},
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"add_dummy_prefix", "false"},
      {"allow_whitespace_only_pieces", "true"},
      {"split_digits", "false"},
      {"unk_id", "0"},
      {"bos_id", "-1"},
      {"eos_id", "-1"},
      {"pad_id", "-1"},
      {"input_sentence_size", "0"},  // we already capped and subsampled deterministically
      {"shuffle_input_sentence", "false"},
      {"max_sentence_length", std::to_string(kMaxSentenceBytes * 2)},
      {"num_threads", std::to_string(std::min(hw, 16u))},
      {"hard_vocab_limit", "true"},
  };

  TrainOutcome outcome;
  {
    QuietLogs quiet;  // also serialises training: the trainer uses process-global state
    outcome = train_in_child([&](std::string* model) {
      sentencepiece::SetRandomGeneratorSeed(1234);
      ViewIterator it(&sentences);
      return sentencepiece::SentencePieceTrainer::Train(kwargs, &it, model);
    });
  }
  const std::string& model = outcome.payload;
  if (!outcome.ok) {
    const std::string& msg = outcome.payload;
    if (msg.find("too high") != std::string::npos) {
      long long max_v = number_after(msg, "<=");
      throw Error("BPE vocab size " + std::to_string(vocab_size) +
                  " is too large for this corpus: SentencePiece can build only " +
                  (max_v > 0 ? std::to_string(max_v) : std::string("fewer")) +
                  " pieces from it; use --vocab-size " +
                  (max_v > 0 ? "<= " + std::to_string(max_v) : std::string("smaller")) +
                  " or a larger corpus");
    }
    if (msg.find("smaller than required_chars") != std::string::npos) {
      // "... required_chars. 300 vs 303." — the second number is the minimum vocab size.
      long long need = number_after(msg, " vs ");
      throw Error("BPE vocab size " + std::to_string(vocab_size) +
                  " is too small for this corpus: it needs 256 byte pieces, <unk> and one piece "
                  "per distinct character" +
                  (need > 0 ? " (" + std::to_string(need) + " in all)" : std::string()) +
                  "; use --vocab-size " +
                  (need > 0 ? ">= " + std::to_string(need) : std::string("larger")) +
                  " (e.g. 4096 for a large corpus)");
    }
    throw Error("training the BPE tokenizer for '" + model_path + "' failed: " + msg);
  }
  write_file_atomic(model_path, model);
}

std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& model_path) {
  // (read whole without a bound: a 20 GB file hung eval; eighteenth hostile pass. The largest
  // SentencePiece models, 256k pieces, are a few MiB.)
  std::string model =
      read_small_file(model_path, kMaxSentencePieceBytes, "a SentencePiece tokenizer model");
  auto tok = std::make_unique<SentencePieceTokenizer>(model, file_name_of(model_path));
  sentencepiece::util::Status st;
  {
    QuietLogs quiet;
    st = tok->sp().LoadFromSerializedProto(absl::string_view(model.data(), model.size()));
  }
  check(st.ok(), "tokenizer model '" + model_path + "' is not a valid SentencePiece model (" +
                     st.ToString() + "); it is corrupt or truncated, retrain it or copy it again");
  check(tok->vocab_size() > 0, "tokenizer model '" + model_path +
                                   "' has an empty vocabulary; "
                                   "retrain it");
  return tok;
}

}  // namespace attnres
