// safetensors.cpp — validating mmap reader and atomic writer for safetensors files.
#include "attnres/safetensors.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "attnres/data.hpp"
#include "attnres/error.hpp"
#include "core/json_field.hpp"

namespace attnres {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; big-endian hosts would need byte swapping");

namespace {

constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;  // same cap as the Python reference

uint64_t fold_text(const std::string& s, uint64_t h) { return checksum64(s.data(), s.size(), h); }

// A tensor's header entry (name, dtype, shape, byte range), so that renamed or reshaped tensors
// are as much a damaged file as altered bytes.
std::string entry_text(const std::string& name, DType dt, const std::vector<int64_t>& shape,
                       uint64_t begin, uint64_t end) {
  std::string t = name + '\0' + dtype_name(dt) + '\0';
  for (int64_t d : shape) t += std::to_string(d) + ',';
  return t + '\0' + std::to_string(begin) + '\0' + std::to_string(end) + '\0';
}

// The metadata entries (sorted by key, as std::map keeps them) but the checksum's own, folded
// into h after the tensor data: an edited config or step is as much a damaged file.
uint64_t fold_metadata(const std::map<std::string, std::string>& meta, uint64_t h) {
  for (const auto& [k, v] : meta) {
    if (k == kDataChecksumKey) continue;
    h = fold_text(k + '\0' + v + '\0', h);
  }
  return h;
}

std::string q(const std::string& s) { return "'" + s + "'"; }

// Whether dir/config.json is a Hugging Face model's configuration: a regular file of at most 1
// MiB naming the model's type or architectures (a user's notes named config.json are not).
bool hf_config_in(const std::filesystem::path& dir) {
  std::error_code ec;
  const std::filesystem::path c = dir / "config.json";
  if (!std::filesystem::is_regular_file(c, ec) || std::filesystem::file_size(c, ec) > (1 << 20)) {
    return false;
  }
  std::ifstream in(c, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return text.find("\"model_type\"") != std::string::npos ||
         text.find("\"architectures\"") != std::string::npos;
}

// A path as one word of a suggested command: quoted where a shell needs it, and never read as
// an option ("-hf" printed import-hf's help).
std::string command_word(const std::string& path) {
  return shell_word(!path.empty() && path[0] == '-' ? "./" + path : path);
}

// A directory given where a checkpoint file belongs: say which file it holds, if any (30th
// hostile pass: --init-from a Hugging Face directory said only "is a directory").
void check_not_a_directory(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return;
  const fs::path dir(path);
  const bool run = fs::exists(dir / "train_config.json", ec);  // (an attnres run's directory)
  if (!run && hf_config_in(dir)) {
    throw Error(q(path) + " is a directory holding a Hugging Face model (config.json), not an " +
                "attnres checkpoint: convert it first with `attnres import-hf " +
                command_word(path) + " --out model.safetensors` and give that file");
  }
  if (fs::is_regular_file(dir / "model.safetensors", ec)) {
    throw Error(q(path) + " is a directory, not a checkpoint file: give its model, " +
                q((dir / "model.safetensors").string()) +
                (run ? " (or a saved step's, checkpoints/step_N/model.safetensors)" : ""));
  }
  if (run && fs::is_directory(dir / "checkpoints", ec)) {
    throw Error(q(path) + " is a run's directory without a final model.safetensors: give a " +
                "saved step's model, " + q((dir / "checkpoints").string()) +
                "/step_N/model.safetensors");
  }
}

// Levenshtein distance, used only to suggest the nearest tensor name in an error message.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// IEEE half -> float, including subnormals, infinities and NaN.
float half_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {
      // Subnormal: normalise the mantissa into float's implicit-one form.
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + (127 - 15)) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

}  // namespace

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::I64:
      return 8;
    case DType::BF16:
    case DType::F16:
      return 2;
    case DType::U8:
      return 1;
  }
  return 0;
}

std::string dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "F32";
    case DType::I32:
      return "I32";
    case DType::I64:
      return "I64";
    case DType::BF16:
      return "BF16";
    case DType::F16:
      return "F16";
    case DType::U8:
      return "U8";
  }
  return "?";
}

bool parse_dtype(const std::string& s, DType* out) {
  static const std::pair<const char*, DType> kAll[] = {{"F32", DType::F32}, {"I32", DType::I32},
                                                       {"I64", DType::I64}, {"BF16", DType::BF16},
                                                       {"F16", DType::F16}, {"U8", DType::U8}};
  for (const auto& [n, t] : kAll) {
    if (s == n) {
      *out = t;
      return true;
    }
  }
  return false;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// ---------------------------------------------------------------------------------------------
// Reader

SafetensorsReader SafetensorsReader::open(const std::string& path) {
  SafetensorsReader r;
  check_not_a_directory(path);
  r.file_ = MappedFile::open(path);
  const std::string f = q(path);
  const uint64_t fsize = r.file_.size();
  check(fsize >= 8, "checkpoint " + f + " is truncated: it has " + std::to_string(fsize) +
                        " bytes but a safetensors file starts with an 8-byte header length; the "
                        "file was not written completely, re-save it");
  uint64_t n = 0;
  std::memcpy(&n, r.file_.data(), 8);
  check(n <= fsize - 8, "checkpoint " + f + " is truncated: header claims " + std::to_string(n) +
                            " bytes but file has " + std::to_string(fsize - 8) +
                            " after the length field; the file was not written completely or is "
                            "not a safetensors file, re-save it");
  check(n <= kMaxHeaderBytes, "checkpoint " + f + " has a " + std::to_string(n) +
                                  "-byte header, over the 100 MiB limit; the file is corrupt or "
                                  "not a safetensors file");
  const char* hbeg = reinterpret_cast<const char*>(r.file_.data() + 8);
  const char* hend = hbeg + n;
  r.data_start_ = r.file_.data() + 8 + n;
  const uint64_t data_size = fsize - 8 - n;

  nlohmann::json header;
  // JSON parsers keep the last of duplicate keys silently; a tensor listed twice would hide one
  // of its byte ranges from the overlap check, so duplicates are rejected first (a linear SAX
  // pass, which also bounds the nesting), then the header is parsed.
  JsonShapeCheck shape(/*unique_keys=*/true);
  nlohmann::json::sax_parse(hbeg, hend, &shape);
  const std::string duplicate = shape.duplicate;
  check(!shape.too_deep, "checkpoint " + f + " has a header nested deeper than " +
                             std::to_string(kMaxJsonDepth) + " levels; the file is corrupt");
  try {
    header = nlohmann::json::parse(hbeg, hend);
  } catch (const nlohmann::json::exception& e) {
    throw Error("checkpoint " + f + " has a header that is not valid JSON (" + e.what() +
                "); the file is corrupt or not a safetensors file");
  }
  check(duplicate.empty(), "checkpoint " + f + ": key " + q(duplicate) +
                               " appears twice in one header object; the file is corrupt");
  check(header.is_object(), "checkpoint " + f +
                                " has a JSON header that is not an object; the "
                                "file is corrupt or not a safetensors file");

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& key = it.key();
    const nlohmann::json& v = it.value();
    if (key == "__metadata__") {
      check(v.is_object(), "checkpoint " + f + ": __metadata__ is not an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        check(m.value().is_string(), "checkpoint " + f + ": __metadata__ entry " + q(m.key()) +
                                         " is not a string; the file is corrupt");
        r.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string t = "tensor " + q(key) + " in " + f;
    check(v.is_object(), t + ": header entry is not an object; the file is corrupt");
    TensorInfo info;
    info.name = key;

    auto dt = v.find("dtype");
    check(dt != v.end() && dt->is_string(), t + ": missing or non-string \"dtype\"");
    check(parse_dtype(dt->get<std::string>(), &info.dtype),
          t + ": unsupported dtype " + q(dt->get<std::string>()) +
              " (supported: F32, I32, I64, BF16, F16, U8); convert the checkpoint");

    auto sh = v.find("shape");
    check(sh != v.end() && sh->is_array(), t + ": missing or non-array \"shape\"");
    uint64_t numel = 1;
    bool overflow = false;
    for (const auto& d : *sh) {
      check(d.is_number_integer(), t + ": shape " + sh->dump() + " has a non-integer dim");
      check(d.is_number_unsigned() || d.get<int64_t>() >= 0,
            t + ": shape " + sh->dump() + " has a negative dim");
      uint64_t dim = d.get<uint64_t>();
      check(dim <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
            t + ": shape " + sh->dump() + " has a dim too large");
      info.shape.push_back(static_cast<int64_t>(dim));
      overflow = overflow || __builtin_mul_overflow(numel, dim, &numel);
    }
    uint64_t nbytes = 0;
    overflow = overflow || __builtin_mul_overflow(numel, uint64_t{dtype_size(info.dtype)}, &nbytes);
    check(!overflow && numel <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
          t + ": shape " + sh->dump() +
              " has an element count that overflows 64 bits; the "
              "file is corrupt");

    auto off = v.find("data_offsets");
    check(off != v.end() && off->is_array() && off->size() == 2,
          t + ": missing \"data_offsets\" [begin, end]");
    for (const auto& o : *off) {
      check(o.is_number_unsigned() || (o.is_number_integer() && o.get<int64_t>() >= 0),
            t + ": data_offsets " + off->dump() + " are not non-negative integers");
    }
    info.begin = (*off)[0].get<uint64_t>();
    info.end = (*off)[1].get<uint64_t>();
    check(info.begin <= info.end,
          t + ": data_offsets " + off->dump() + " have begin > end; the file is corrupt");
    check(info.end <= data_size, t + ": data_offsets " + off->dump() +
                                     " run past the data section (" + std::to_string(data_size) +
                                     " bytes); the file is truncated, re-save it");
    check(info.end - info.begin == nbytes,
          t + ": shape " + shape_str(info.shape) + " of " + dtype_name(info.dtype) + " needs " +
              std::to_string(nbytes) + " bytes but data_offsets " + off->dump() + " span " +
              std::to_string(info.end - info.begin) + "; the file is corrupt");
    r.tensors_.emplace(key, std::move(info));
  }

  // Overlapping ranges would let one tensor's writes alias another's; reject them.
  std::vector<const TensorInfo*> order;
  order.reserve(r.tensors_.size());
  for (const auto& [k, ti] : r.tensors_) {
    if (ti.end > ti.begin) order.push_back(&ti);
  }
  std::sort(order.begin(), order.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  for (size_t i = 1; i < order.size(); ++i) {
    check(order[i]->begin >= order[i - 1]->end,
          "checkpoint " + f + ": tensors " + q(order[i - 1]->name) + " [" +
              std::to_string(order[i - 1]->begin) + "," + std::to_string(order[i - 1]->end) +
              ") and " + q(order[i]->name) + " [" + std::to_string(order[i]->begin) + "," +
              std::to_string(order[i]->end) + ") overlap; the file is corrupt");
  }
  // The checksum an attnres writer records (files of other writers have none): bytes altered
  // since the save (bad sectors, an edit in place) must not load as a model.
  const auto rec = r.metadata_.find(kDataChecksumKey);
  // A key that is the checksum's name with a byte or a few damaged: the checksum is there, its
  // name is not (skipping the check would load the damage it records). Deliberate edits of a
  // header are beyond a checksum, which is no signature.
  for (const auto& [k, v] : r.metadata_) {
    const std::string key = kDataChecksumKey;
    if (rec != r.metadata_.end() || k.size() != key.size()) continue;
    int differ = 0;
    for (size_t i = 0; i < k.size(); i++) differ += k[i] != key[i];
    check(differ > 3, "checkpoint " + f + ": its metadata key " + q(k) +
                          " is the checksum's name damaged (" + key +
                          "): the file was altered or damaged after it was written; use another "
                          "checkpoint, or re-save it from a good copy");
  }
  if (rec != r.metadata_.end()) {
    // An attnres writer ends the file with its last tensor: bytes past it were appended (4 GiB
    // of them were copied whole to be checksummed; seventeenth hostile pass).
    const uint64_t used = order.empty() ? 0 : order.back()->end;
    check(data_size == used, "checkpoint " + f + " has " + std::to_string(data_size - used) +
                                 " bytes after its last tensor, which an attnres save never "
                                 "leaves: the file was appended to or damaged; use another "
                                 "checkpoint, or re-save it from a good copy");
    r.owned_.assign(r.data_start_, r.data_start_ + data_size);
    r.data_start_ = r.owned_.data();
    uint64_t sum = kFnv1a64Offset;
    for (const TensorInfo* ti : order)
      sum = checksum64(r.data_start_ + ti->begin, ti->end - ti->begin, sum);
    for (const auto& [name, ti] : r.tensors_)
      sum = fold_text(entry_text(name, ti.dtype, ti.shape, ti.begin, ti.end), sum);
    sum = fold_metadata(r.metadata_, sum);
    check(rec->second == hex64(sum),
          "checkpoint " + f +
              " does not hold the tensor data and metadata it was saved with (checksum "
              "mismatch): it was altered or damaged after it was written; use another "
              "checkpoint, or re-save it from a good copy");
  }
  return r;
}

const TensorInfo& SafetensorsReader::info(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it != tensors_.end()) return it->second;
  std::string msg = "tensor " + q(name) + " not found in " + q(path()) + " (";
  if (tensors_.empty()) {
    msg += "it has no tensors";
  } else {
    std::string best;
    size_t best_d = std::numeric_limits<size_t>::max();
    for (const auto& [k, v] : tensors_) {
      if (k.size() > 256 || name.size() > 256) continue;  // keep the suggestion cheap
      size_t d = edit_distance(k, name);
      if (d < best_d) {
        best_d = d;
        best = k;
      }
    }
    if (best_d <= std::max<size_t>(2, name.size() / 4)) msg += "did you mean " + q(best) + "? ";
    msg += "it has " + std::to_string(tensors_.size()) + " tensors: ";
    size_t shown = 0;
    for (const auto& [k, v] : tensors_) {
      if (shown == 5) {
        msg += ", ...";
        break;
      }
      msg += (shown++ ? ", " : "") + q(k);
    }
  }
  msg +=
      "); the checkpoint may come from a different model config, check the config it was "
      "saved with";
  throw Error(msg);
}

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [k, v] : tensors_) out.push_back(k);
  return out;
}

const uint8_t* SafetensorsReader::raw(const std::string& name) const {
  return data_start_ + info(name).begin;
}

void SafetensorsReader::read_f32(const std::string& name,
                                 const std::vector<int64_t>& expected_shape, float* dst) const {
  const TensorInfo& ti = info(name);
  check(ti.shape == expected_shape, "tensor " + q(name) + " in " + q(path()) + ": expected shape " +
                                        shape_str(expected_shape) + ", found " +
                                        shape_str(ti.shape) +
                                        "; the checkpoint was saved with a different model config");
  const uint8_t* src = data_start_ + ti.begin;
  const size_t n = static_cast<size_t>(ti.numel());
  switch (ti.dtype) {
    case DType::F32:
      if (n) std::memcpy(dst, src, n * 4);
      return;
    case DType::BF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
      }
      return;
    case DType::F16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = half_to_float(h);
      }
      return;
    default:
      throw Error("tensor " + q(name) + " in " + q(path()) +
                  ": expected a float tensor (F32, "
                  "BF16 or F16), found " +
                  dtype_name(ti.dtype) +
                  "; the file is not a model "
                  "checkpoint of this engine or the tensor name is wrong");
  }
}

std::vector<float> SafetensorsReader::read_f32(const std::string& name) const {
  const TensorInfo& ti = info(name);
  std::vector<float> out(static_cast<size_t>(ti.numel()));
  read_f32(name, ti.shape, out.data());
  return out;
}

std::vector<int32_t> SafetensorsReader::read_i32(const std::string& name) const {
  const TensorInfo& ti = info(name);
  const uint8_t* src = data_start_ + ti.begin;
  const size_t n = static_cast<size_t>(ti.numel());
  std::vector<int32_t> out(n);
  if (ti.dtype == DType::I32) {
    if (n) std::memcpy(out.data(), src, n * 4);
  } else if (ti.dtype == DType::I64) {
    for (size_t i = 0; i < n; ++i) {
      int64_t v;
      std::memcpy(&v, src + 8 * i, 8);
      check(v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max(),
            "tensor " + q(name) + " in " + q(path()) + ": I64 value " + std::to_string(v) +
                " at index " + std::to_string(i) + " does not fit in int32");
      out[i] = static_cast<int32_t>(v);
    }
  } else {
    throw Error("tensor " + q(name) + " in " + q(path()) +
                ": expected an integer tensor (I32 or "
                "I64), found " +
                dtype_name(ti.dtype) +
                "; the tensor name is wrong or the file "
                "is from another program");
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Writer

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) {
  metadata_[key] = value;
}

void SafetensorsWriter::add(const std::string& name, DType dtype, std::vector<int64_t> shape,
                            const void* data) {
  check(!name.empty(), "cannot save a tensor with an empty name");
  check(name != "__metadata__", "cannot save a tensor named '__metadata__' (reserved)");
  for (const auto& e : entries_) {
    check(e.name != name, "cannot save tensor " + q(name) + " twice in one checkpoint");
  }
  uint64_t numel = 1;
  for (int64_t d : shape) {
    check(d >= 0, "tensor " + q(name) + " has negative dim in shape " + shape_str(shape));
    check(!__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel),
          "tensor " + q(name) + " shape " + shape_str(shape) + " overflows");
  }
  uint64_t nbytes = 0;
  check(!__builtin_mul_overflow(numel, uint64_t{dtype_size(dtype)}, &nbytes),
        "tensor " + q(name) + " shape " + shape_str(shape) + " overflows");
  check(nbytes == 0 || data != nullptr, "tensor " + q(name) + " has no data pointer");
  entries_.push_back(Entry{name, dtype, std::move(shape), data, nbytes});
}

void SafetensorsWriter::add_f32(const std::string& name, std::vector<int64_t> shape,
                                const float* data) {
  add(name, DType::F32, std::move(shape), data);
}

void SafetensorsWriter::add_i32(const std::string& name, std::vector<int64_t> shape,
                                const int32_t* data) {
  add(name, DType::I32, std::move(shape), data);
}

void SafetensorsWriter::write(const std::string& path) const {
  // ordered_json keeps tensors in insertion order, matching the data layout, for easy inspection.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  uint64_t sum = kFnv1a64Offset;
  std::map<std::string, std::string> table;  // (by name, as the reader's map keeps them)
  uint64_t at = 0;
  for (const auto& e : entries_) {
    sum = checksum64(static_cast<const uint8_t*>(e.data), e.nbytes, sum);
    table[e.name] = entry_text(e.name, e.dtype, e.shape, at, at + e.nbytes);
    at += e.nbytes;
  }
  for (const auto& [name, text] : table) sum = fold_text(text, sum);
  nlohmann::ordered_json m = nlohmann::ordered_json::object();
  for (const auto& [k, v] : metadata_) m[k] = v;
  m[kDataChecksumKey] = hex64(fold_metadata(metadata_, sum));
  header["__metadata__"] = std::move(m);
  uint64_t offset = 0;
  for (const auto& e : entries_) {
    nlohmann::ordered_json t = nlohmann::ordered_json::object();
    t["dtype"] = dtype_name(e.dtype);
    t["shape"] = e.shape;
    t["data_offsets"] = {offset, offset + e.nbytes};
    header[e.name] = std::move(t);
    offset += e.nbytes;
  }
  std::string hs;
  try {
    hs = header.dump();
  } catch (const nlohmann::json::exception& ex) {
    throw Error("cannot write " + q(path) +
                ": a tensor name or metadata value is not valid "
                "UTF-8 (" +
                ex.what() + ")");
  }
  // Pad with spaces so the data section starts 8-byte aligned, as the reference writer does.
  hs.append((8 - hs.size() % 8) % 8, ' ');
  uint64_t n = hs.size();
  AtomicFileWriter w(path);
  w.write(&n, 8);
  w.write(hs);
  for (const auto& e : entries_) w.write(e.data, e.nbytes);
  w.commit();
}

}  // namespace attnres
