// Tests for attnres/safetensors.hpp: round trips and rejection of malformed files.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/safetensors.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using namespace attnres;

namespace {

using attnres::testing::TempDir;

// Builds a safetensors file from a raw header string and data bytes.
std::string make_file(const std::string& header, const std::string& data,
                      int64_t claimed_len = -1) {
  uint64_t n = claimed_len >= 0 ? static_cast<uint64_t>(claimed_len) : header.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

// Asserts that opening (and then running `then` on) `bytes` throws an Error whose message
// contains the file name and `needle`.
void expect_bad(const TempDir& d, const std::string& name, const std::string& bytes,
                const std::string& needle) {
  const std::string p = d.file(name);
  write_file_atomic(p, bytes);
  try {
    SafetensorsReader::open(p);
    ADD_FAILURE() << name << ": expected Error containing '" << needle << "'";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(name), std::string::npos) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << "missing '" << needle << "' in: " << msg;
  }
}

}  // namespace

TEST(Safetensors, DtypeHelpers) {
  EXPECT_EQ(dtype_size(DType::F32), 4u);
  EXPECT_EQ(dtype_size(DType::I64), 8u);
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::U8), 1u);
  EXPECT_EQ(dtype_name(DType::BF16), "BF16");
  DType t;
  EXPECT_TRUE(parse_dtype("I32", &t));
  EXPECT_EQ(t, DType::I32);
  EXPECT_FALSE(parse_dtype("F64", &t));
  EXPECT_EQ(shape_str({2, 3}), "[2,3]");
  EXPECT_EQ(shape_str({}), "[]");
}

TEST(Safetensors, RoundTripF32I32AndMetadata) {
  TempDir d;
  const std::string p = d.file("model.safetensors");
  std::vector<float> w(2 * 3), b(5), scalar{3.5f};
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.25f * static_cast<float>(i) - 1.0f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = 1e-3f * static_cast<float>(i * i);
  std::vector<int32_t> ids{7, -1, 2147483647, 0};
  SafetensorsWriter sw;
  sw.set_metadata("config", "{\"dim\": 64}");
  sw.set_metadata("step", "123");
  sw.add_f32("layers.0.w", {2, 3}, w.data());
  sw.add_i32("ids", {4}, ids.data());
  sw.add_f32("b", {5}, b.data());  // odd count: later tensors must still be placed correctly
  sw.add_f32("scalar", {}, scalar.data());
  sw.add_f32("empty", {0, 4}, nullptr);
  sw.write(p);

  std::string bytes = read_file(p);
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u) << "header must be padded to a multiple of 8";
  // Tensors appear in insertion order in the data section.
  EXPECT_LT(bytes.find("layers.0.w"), bytes.find("\"ids\""));

  SafetensorsReader r = SafetensorsReader::open(p);
  EXPECT_EQ(r.path(), p);
  EXPECT_EQ(r.metadata().at("config"), "{\"dim\": 64}");
  EXPECT_EQ(r.metadata().at("step"), "123");
  EXPECT_EQ(r.size(), 5u);
  EXPECT_TRUE(r.has("b"));
  EXPECT_FALSE(r.has("c"));
  EXPECT_EQ(r.names(), (std::vector<std::string>{"b", "empty", "ids", "layers.0.w", "scalar"}));
  EXPECT_EQ(r.info("layers.0.w").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(r.info("layers.0.w").numel(), 6);
  EXPECT_EQ(r.info("scalar").numel(), 1);
  EXPECT_EQ(r.info("empty").numel(), 0);
  EXPECT_EQ(r.info("ids").dtype, DType::I32);
  EXPECT_EQ(r.read_f32("layers.0.w"), w);
  EXPECT_EQ(r.read_f32("b"), b);
  EXPECT_EQ(r.read_f32("scalar"), scalar);
  EXPECT_TRUE(r.read_f32("empty").empty());
  EXPECT_EQ(r.read_i32("ids"), ids);
  std::vector<float> dst(6);
  r.read_f32("layers.0.w", {2, 3}, dst.data());
  EXPECT_EQ(dst, w);
  float first;
  std::memcpy(&first, r.raw("layers.0.w"), 4);
  EXPECT_EQ(first, w[0]);
}

// Eleventh hostile pass: a checkpoint whose tensor bytes were zeroed in place (header intact)
// loaded as a model and eval printed ln(vocab) as its loss. The writer records a checksum of the
// data, and the reader refuses altered bytes; files of other writers (no checksum) still load.
TEST(Safetensors, AlteredTensorDataIsRefused) {
  TempDir d;
  const std::string p = d.file("m.safetensors");
  std::vector<float> w(37);
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.5f * static_cast<float>(i) - 3.0f;
  SafetensorsWriter sw;
  sw.set_metadata("config", "{\"block_size\":2,\"norm_eps\":1e-10}");
  sw.add_f32("a", {37}, w.data());
  sw.add_f32("b", {5}, w.data() + 3);
  sw.write(p);
  const std::string good = read_file(p);
  ASSERT_EQ(SafetensorsReader::open(p).metadata().count(kDataChecksumKey), 1u);
  uint64_t n;
  std::memcpy(&n, good.data(), 8);
  for (const uint64_t at : {uint64_t{0}, uint64_t{37 * 4 - 1}, uint64_t{37 * 4 + 19}}) {
    std::string bad = good;
    bad[8 + n + at] ^= 0x01;  // one bit, in the first byte, a tail byte, the last tensor
    write_file_atomic(p, bad);
    try {
      SafetensorsReader::open(p);
      ADD_FAILURE() << "an altered byte at " << at << " loaded";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("checksum mismatch"), std::string::npos) << e.what();
    }
  }
  // Seventeenth hostile pass: bytes appended past the last tensor (4 GiB of them were copied
  // whole to be checksummed) are refused as damage, unread.
  for (const size_t extra : {size_t{1}, size_t{4096}}) {
    write_file_atomic(p, good + std::string(extra, '\0'));
    try {
      SafetensorsReader::open(p);
      ADD_FAILURE() << extra << " appended bytes loaded";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::to_string(extra) + " bytes after its last tensor"),
                std::string::npos)
          << e.what();
    }
  }
  // Twelfth hostile pass: one byte of the config edited (block_size 2 -> 4, a key misspelt so
  // that its default applied, norm_eps 1e-10 -> 1e-01) loaded as another model.
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"\\\"block_size\\\":2", "\\\"block_size\\\":4"},
           {"block_size", "block_sizf"},
           {"1e-10", "1e-01"}}) {
    std::string bad = good;
    const size_t at = bad.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    bad.replace(at, from.size(), to);
    write_file_atomic(p, bad);
    try {
      SafetensorsReader::open(p);
      ADD_FAILURE() << "an edited config (" << to << ") loaded";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("checksum mismatch"), std::string::npos) << e.what();
    }
  }
  // Thirteenth pass: two flipped sign bits cancelled in a plain word-wise FNV, and the tensor
  // table (names, shapes, offsets) was not covered: swapped names loaded.
  {
    std::string bad = good;
    bad[8 + n + 3] ^= static_cast<char>(0x80);  // the sign bits of a[0] and a[2]
    bad[8 + n + 11] ^= static_cast<char>(0x80);
    write_file_atomic(p, bad);
    EXPECT_THROW(SafetensorsReader::open(p), Error) << "two sign flips";
    bad = good;
    const size_t ia = bad.find("\"a\""), ib = bad.find("\"b\"");
    ASSERT_TRUE(ia != std::string::npos && ib != std::string::npos && ia < 8 + n && ib < 8 + n);
    bad[ia + 1] = 'b';
    bad[ib + 1] = 'a';
    write_file_atomic(p, bad);
    EXPECT_THROW(SafetensorsReader::open(p), Error) << "swapped names";
  }
  // Fourteenth pass: one damaged byte in the checksum key's name turned the check off, and a
  // checkpoint with damaged data loaded.
  {
    std::string bad = good;
    const size_t at = bad.find(kDataChecksumKey);
    ASSERT_TRUE(at != std::string::npos && at < 8 + n);
    bad[at + std::strlen(kDataChecksumKey) - 1] = 'x';
    bad[8 + n] ^= 0x01;
    write_file_atomic(p, bad);
    try {
      SafetensorsReader::open(p);
      ADD_FAILURE() << "a damaged checksum name turned the check off";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("is the checksum's name damaged"), std::string::npos)
          << e.what();
    }
  }
  // Without the key (another writer's file), the data is taken as it is.
  std::string header = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
  header.append((8 - header.size() % 8) % 8, ' ');
  const uint64_t hn = header.size();
  std::string plain(reinterpret_cast<const char*>(&hn), 8);
  plain += header + std::string(8, '\0');
  write_file_atomic(p, plain);
  EXPECT_EQ(SafetensorsReader::open(p).read_f32("a"), (std::vector<float>{0.0f, 0.0f}));
}

// Fifteenth hostile pass: the checksum was computed on the memory map and the tensors were read
// from it again later: a file rewritten in place between the two loaded as a mix of two models.
// A checksummed file's data is copied once; what was checked is what is read.
TEST(Safetensors, ACheckedFileIsReadAsItWasChecked) {
  TempDir d;
  const std::string p = d.file("m.safetensors");
  std::vector<float> w(64, 1.5f), other(64, -2.0f);
  SafetensorsWriter sw;
  sw.add_f32("a", {64}, w.data());
  sw.write(p);
  const SafetensorsReader r = SafetensorsReader::open(p);
  std::string bytes = read_file(p);
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  std::memcpy(bytes.data() + 8 + n, other.data(), 64 * sizeof(float));
  {  // in place: the same inode, so the mapping sees it
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  EXPECT_EQ(r.read_f32("a"), w);
}

TEST(Safetensors, ReadsBF16F16AndI64) {
  TempDir d;
  // bf16 1.0 = 0x3f80, -2.0 = 0xc000; f16 1.0 = 0x3c00, 0.5 = 0x3800, smallest subnormal 0x0001.
  std::string data;
  auto put16 = [&](uint16_t v) { data.append(reinterpret_cast<const char*>(&v), 2); };
  put16(0x3f80);
  put16(0xc000);
  put16(0x3c00);
  put16(0x3800);
  put16(0x0001);
  put16(0xfc00);  // -inf
  int64_t big[2] = {5, -6};
  data.append(reinterpret_cast<const char*>(big), 16);
  std::string h = R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},)"
                  R"("h":{"dtype":"F16","shape":[4],"data_offsets":[4,12]},)"
                  R"("l":{"dtype":"I64","shape":[2],"data_offsets":[12,28]}})";
  const std::string p = d.file("mixed.safetensors");
  write_file_atomic(p, make_file(h, data));
  SafetensorsReader r = SafetensorsReader::open(p);
  EXPECT_EQ(r.read_f32("a"), (std::vector<float>{1.0f, -2.0f}));
  std::vector<float> hv = r.read_f32("h");
  EXPECT_EQ(hv[0], 1.0f);
  EXPECT_EQ(hv[1], 0.5f);
  EXPECT_FLOAT_EQ(hv[2], 5.9604645e-8f);
  EXPECT_TRUE(std::isinf(hv[3]) && hv[3] < 0);
  EXPECT_EQ(r.read_i32("l"), (std::vector<int32_t>{5, -6}));
  EXPECT_THROW(r.read_i32("a"), Error);
  EXPECT_THROW(r.read_f32("l"), Error);
}

TEST(Safetensors, RejectsMalformedFiles) {
  TempDir d;
  const std::string good_h = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string data8(8, '\0');

  expect_bad(d, "tiny.safetensors", "abc", "truncated");
  expect_bad(d, "trunc_header.safetensors", make_file(good_h, data8, 4000), "truncated");
  // 1 TB claimed header: must fail on the bounds check, not try to allocate.
  expect_bad(d, "huge_header.safetensors", make_file(good_h, data8, int64_t{1} << 40),
             "header claims");
  expect_bad(d, "notjson.safetensors", make_file("this is not json", ""), "not valid JSON");
  expect_bad(d, "array.safetensors", make_file("[1,2,3]", ""), "not an object");
  expect_bad(d, "badmeta.safetensors", make_file(R"({"__metadata__":{"a":1}})", ""),
             "__metadata__");
  expect_bad(d, "dtype.safetensors",
             make_file(R"({"w":{"dtype":"F99","shape":[2],"data_offsets":[0,8]}})", data8),
             "unsupported dtype");
  expect_bad(d, "negdim.safetensors",
             make_file(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data8),
             "negative dim");
  expect_bad(d, "mismatch.safetensors",
             make_file(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data8),
             "needs 12 bytes");
  expect_bad(d, "past_end.safetensors",
             make_file(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", data8),
             "past the data section");
  expect_bad(d, "backwards.safetensors",
             make_file(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", data8),
             "begin > end");
  expect_bad(d, "overflow.safetensors",
             make_file(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],)"
                       R"("data_offsets":[0,8]}})",
                       data8),
             "overflows");
  expect_bad(d, "overlap.safetensors",
             make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                       std::string(12, '\0')),
             "overlap");
  expect_bad(d, "dup.safetensors",
             make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("a":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                       std::string(12, '\0')),
             "appears twice");
  expect_bad(d, "nooffsets.safetensors", make_file(R"({"w":{"dtype":"F32","shape":[2]}})", data8),
             "data_offsets");
  // Error names the tensor at fault.
  expect_bad(d, "named.safetensors",
             make_file(R"({"tok_emb":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data8),
             "tok_emb");
  expect_bad(d, "empty.safetensors", "", "truncated");

  // A file cut short after a valid write.
  const std::string p = d.file("cut.safetensors");
  std::vector<float> v(100, 1.0f);
  SafetensorsWriter w;
  w.add_f32("v", {100}, v.data());
  w.write(p);
  std::string bytes = read_file(p);
  expect_bad(d, "cut.safetensors", bytes.substr(0, bytes.size() - 10), "past the data section");
  expect_bad(d, "cut.safetensors", bytes.substr(0, 20), "truncated");
}

TEST(Safetensors, MissingTensorAndWrongShape) {
  TempDir d;
  const std::string p = d.file("ck.safetensors");
  std::vector<float> w(6, 0.5f);
  std::vector<int32_t> i(2, 1);
  SafetensorsWriter sw;
  sw.add_f32("tok_embeddings.weight", {3, 2}, w.data());
  sw.add_i32("step", {2}, i.data());
  sw.write(p);
  SafetensorsReader r = SafetensorsReader::open(p);
  try {
    r.info("tok_embedding.weight");
    FAIL();
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("ck.safetensors"), std::string::npos) << msg;
    EXPECT_NE(msg.find("did you mean 'tok_embeddings.weight'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("different model config"), std::string::npos) << msg;
  }
  std::vector<float> dst(6);
  try {
    r.read_f32("tok_embeddings.weight", {2, 3}, dst.data());
    FAIL();
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("tensor 'tok_embeddings.weight' in"), std::string::npos) << msg;
    EXPECT_NE(msg.find("ck.safetensors"), std::string::npos) << msg;
    EXPECT_NE(msg.find("expected shape [2,3], found [3,2]"), std::string::npos) << msg;
  }
  try {
    r.read_f32("step", {2}, dst.data());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("I32"), std::string::npos) << e.what();
  }
  EXPECT_THROW(r.raw("nope"), Error);
}

TEST(Safetensors, WriterRejectsBadInput) {
  SafetensorsWriter w;
  float x = 1;
  w.add_f32("x", {1}, &x);
  EXPECT_THROW(w.add_f32("x", {1}, &x), Error);             // duplicate
  EXPECT_THROW(w.add_f32("__metadata__", {1}, &x), Error);  // reserved
  EXPECT_THROW(w.add_f32("y", {-1}, &x), Error);            // negative dim
  EXPECT_THROW(w.add_f32("z", {2}, nullptr), Error);        // no data
  EXPECT_THROW(w.add_f32("", {1}, &x), Error);
  TempDir d;
  EXPECT_THROW(w.write(d.file("missing_dir/x.safetensors")), Error);
}

TEST(Safetensors, EmptyFileWithOnlyMetadata) {
  TempDir d;
  const std::string p = d.file("meta.safetensors");
  SafetensorsWriter w;
  w.set_metadata("format", "pt");
  w.write(p);
  SafetensorsReader r = SafetensorsReader::open(p);
  EXPECT_EQ(r.size(), 0u);
  EXPECT_EQ(r.metadata().at("format"), "pt");
}

// Cross-check with the reference implementation when it happens to be installed; the test
// passes without Python. $ATTNRES_PYTHON overrides the interpreter (e.g. a venv's python).
TEST(Safetensors, PythonInteropIfAvailable) {
  const char* env = std::getenv("ATTNRES_PYTHON");
  const std::string python = env && *env ? env : "/usr/bin/python3";
  if (std::system((python + " -c 'import safetensors.numpy' >/dev/null 2>&1").c_str()) != 0) {
    GTEST_SKIP() << python << " has no safetensors module";
  }
  TempDir d;
  const std::string p = d.file("interop.safetensors");
  std::vector<float> w{1.5f, -2.0f, 3.0f, 4.25f};
  std::vector<int32_t> i{1, 2, 3};
  SafetensorsWriter sw;
  sw.set_metadata("k", "v");
  float scalar = 9.0f;
  sw.add_i32("i", {3}, i.data());
  sw.add_f32("w", {2, 2}, w.data());
  sw.add_f32("empty", {0, 3}, nullptr);
  sw.add_f32("s", {}, &scalar);
  sw.write(p);
  const std::string py = d.file("check.py");
  write_file_atomic(py,
                    "import sys\n"
                    "from safetensors.numpy import load_file, save_file\n"
                    "t = load_file(sys.argv[1])\n"
                    "assert t['w'].tolist() == [[1.5, -2.0], [3.0, 4.25]], t['w']\n"
                    "assert t['i'].tolist() == [1, 2, 3]\n"
                    "assert t['empty'].shape == (0, 3) and float(t['s']) == 9.0\n"
                    "save_file({'z': t['w'] * 2}, sys.argv[2], metadata={'m': 'x'})\n");
  const std::string out = d.file("from_py.safetensors");
  ASSERT_EQ(std::system((python + " " + py + " " + p + " " + out).c_str()), 0);
  SafetensorsReader r = SafetensorsReader::open(out);
  EXPECT_EQ(r.read_f32("z"), (std::vector<float>{3.0f, -4.0f, 6.0f, 8.5f}));
  EXPECT_EQ(r.metadata().at("m"), "x");
}
