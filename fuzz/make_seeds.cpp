// Writes the seed corpora of the fuzz targets with the engine's own writers:
//   fuzz_make_seeds <dir>   (scripts/fuzz.sh --seeds runs it into fuzz/corpus)
// Seeds are tiny valid files, plus a few hand-made edge cases; libFuzzer mutates from there.
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

#include "attnres/checkpoint.hpp"
#include "attnres/data.hpp"
#include "attnres/fileio.hpp"
#include "attnres/tokenizer.hpp"
#include "attnres/train.hpp"
#include "fuzz_util.hpp"

namespace fs = std::filesystem;
using namespace attnres;

namespace {

void put(const fs::path& dir, const std::string& name, const std::string& bytes) {
  fs::create_directories(dir);
  write_file_atomic((dir / name).string(), bytes);
}

// A safetensors file by hand (the writer only emits F32/I32): header JSON, then data.
std::string raw_safetensors(const std::string& header, const std::string& body) {
  std::string h = header;
  h.append((8 - h.size() % 8) % 8, ' ');
  uint64_t n = h.size();
  std::string out(reinterpret_cast<const char*>(&n), 8);
  return out + h + body;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_make_seeds <corpus dir>\n");
    return 2;
  }
  const fs::path root = argv[1];
  const fs::path tmp = fs::path(fuzz::scratch_dir());

  // fuzz_safetensors: the small model fuzz_safetensors.cpp also builds, its optimizer state,
  // other dtypes, and a header that claims a terabyte.
  const ModelConfig c = fuzz::tiny_model_config();
  Model m(c);
  m.init_weights(1);
  AdamW opt(m.layout(), AdamWConfig{});
  save_model((tmp / "m").string(), m, {{"tokenizer", "byte"}, {"step", "3"}});
  save_optimizer((tmp / "o").string(), m, opt, {{"step", "3"}});
  const fs::path st = root / "fuzz_safetensors";
  put(st, "model.safetensors", read_file((tmp / "m").string()));
  put(st, "optimizer.safetensors", read_file((tmp / "o").string()));
  put(st, "dtypes.safetensors",
      raw_safetensors(
          R"({"__metadata__":{"k":"v"},"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},)"
          R"("b":{"dtype":"F16","shape":[1,2],"data_offsets":[4,8]},)"
          R"("c":{"dtype":"I64","shape":[1],"data_offsets":[8,16]},)"
          R"("d":{"dtype":"U8","shape":[],"data_offsets":[16,17]}})",
          std::string("\x80\x3f\x00\xc0\x00\x3c\x00\x7c\x05\x00\x00\x00\x00\x00\x00\x00\x07", 17)));
  put(st, "huge_header.safetensors", std::string("\x00\x00\x00\x00\x00\x01\x00\x00{}", 10));
  put(st, "huge_tensor.safetensors",
      raw_safetensors(R"({"w":{"dtype":"F32","shape":[1000000,1000000],"data_offsets":[0,4]}})",
                      std::string(4, '\0')));

  // fuzz_config: the JSON forms and a TOML file.
  const fs::path cf = root / "fuzz_config";
  TrainConfig tc;
  tc.model.residual.mode = ResidualMode::full;
  put(cf, "model_config.json", tc.model.to_json());
  put(cf, "train_config.json", tc.to_json());
  put(cf, "train.toml",
      "[train]\nsteps = 7\nn-layer = 1\nd-model = 16\nn-head = 2\nseq-len = 16\n"
      "batch-size = 2\nlr = 0.002\nresidual = \"block\"\nschedule = \"wsd\"\n");
  put(cf, "train.ini", "steps=3\n[train]\nuntied=true\ntokenizer=bpe\nvocab-size=300\n");

  // fuzz_tokenizer: a small BPE model, and reference strings.
  const fs::path tk = root / "fuzz_tokenizer";
  std::string text;
  for (int i = 0; i < 40; i++) text += "the cat sees " + std::to_string(i % 7) + " red apples.\n";
  train_sentencepiece(text, 280, (tmp / "t.model").string());
  put(tk, "tokenizer.model", read_file((tmp / "t.model").string()));
  put(tk, "ref_byte", "byte\n");
  put(tk, "ref_sp", "sentencepiece:tokenizer.model\n");

  // fuzz_token_cache: a valid cache for the target's key and vocabulary.
  std::vector<int32_t> ids;
  for (int i = 0; i < 24; i++) ids.push_back((i * 37) % fuzz::kCacheVocab);
  write_token_cache((tmp / "tokens.bin").string(), ids, fuzz::kCacheVocab, fuzz::kCacheKey);
  put(root / "fuzz_token_cache", "tokens.bin", read_file((tmp / "tokens.bin").string()));

  // fuzz_corpus: plain text, invalid UTF-8 of every kind, a NUL byte.
  const fs::path co = root / "fuzz_corpus";
  put(co, "text.txt", "hello world\nsecond line \xc3\xbc \xe2\x82\xac \xf0\x9f\x98\x80\n");
  put(co, "invalid.txt",
      "a\xc3(b \xed\xa0\x80 \xf4\x90\x80\x80 \xe0\x80\xaf \xf0\x9f\x98 \xff\xfe end");
  put(co, "nul.bin", std::string("text\0more", 9));
  put(co, "blank.txt", "\n\n\n");

  fs::remove_all(tmp);
  std::printf("seeds written under %s\n", root.c_str());
  return 0;
}
