// attnres/safetensors.hpp — reader and writer for the safetensors checkpoint format.
//
// Layout: u64 little-endian header length N, N bytes of JSON
//   {"__metadata__": {str: str}, "<name>": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}}
// then the raw tensor bytes; offsets are relative to the first byte after the header.
// The reader memory-maps the file and validates every header field against the file size before
// anything is used, so a truncated or hostile file produces an Error, never a crash or a huge
// allocation. Files written here load with Python's safetensors and safetensors.torch.load_file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "attnres/fileio.hpp"

namespace attnres {

enum class DType { F32, I32, I64, BF16, F16, U8 };

// Bytes per element of `t`.
size_t dtype_size(DType t);
// The safetensors spelling of `t` ("F32", "I32", ...).
std::string dtype_name(DType t);
// Parses a safetensors dtype string; returns false for dtypes this engine does not support.
bool parse_dtype(const std::string& s, DType* out);

// Formats a shape as "[2,3]" for error messages.
std::string shape_str(const std::vector<int64_t>& shape);

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range relative to the start of the data section
  // Product of the dims (1 for a scalar); overflow was ruled out when the file was opened.
  int64_t numel() const;
};

// Every file SafetensorsWriter writes records in its __metadata__, under this key, a checksum of
// its tensor data, tensor table and other metadata (16 hex digits: checksum64 (attnres/data.hpp)
// of each tensor's bytes in file order, then of each tensor's entry
// "name\0dtype\0dims,\0begin\0end\0" by name, then of each other metadata entry
// "key\0value\0" by key); SafetensorsReader::open verifies it where present.
inline constexpr const char* kDataChecksumKey = "attnres_fnv1a64w";

class SafetensorsReader {
 public:
  // Maps and fully validates `path`; throws Error naming the file, tensor and problem.
  static SafetensorsReader open(const std::string& path);

  // The "__metadata__" string map (empty if the file has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // True if a tensor named `name` exists.
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  // Header entry of `name`; Error listing some existing names if it is missing.
  const TensorInfo& info(const std::string& name) const;
  // All tensor names, sorted.
  std::vector<std::string> names() const;
  // Pointer to the tensor's first byte inside the mapping (may be unaligned for its dtype).
  const uint8_t* raw(const std::string& name) const;
  // Copies tensor `name` into dst as float32 after checking its shape equals `expected_shape`.
  // F32 is copied; BF16/F16 are widened; any other dtype is an Error.
  void read_f32(const std::string& name, const std::vector<int64_t>& expected_shape,
                float* dst) const;
  // Returns tensor `name` as float32 (any shape; dtype rules as above).
  std::vector<float> read_f32(const std::string& name) const;
  // Returns tensor `name` as int32 (I32 copied; I64 narrowed with a range check).
  std::vector<int32_t> read_i32(const std::string& name) const;
  // Path the reader was opened with.
  const std::string& path() const { return file_.path(); }
  // Number of tensors in the file.
  size_t size() const { return tensors_.size(); }

 private:
  MappedFile file_;
  const uint8_t* data_start_ = nullptr;  // first byte after the header
  // A checksummed file's data section, copied out of the mapping: the bytes checked are the bytes
  // used (a file rewritten in place while it loaded gave a mix of two models that passed the
  // check made on the mapping; fifteenth hostile pass).
  std::vector<uint8_t> owned_;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, TensorInfo> tensors_;
};

class SafetensorsWriter {
 public:
  // Adds a "__metadata__" entry (later calls with the same key overwrite).
  void set_metadata(const std::string& key, const std::string& value);
  // Queues a float32 tensor; `data` (numel floats) must stay valid until write() returns.
  void add_f32(const std::string& name, std::vector<int64_t> shape, const float* data);
  // Queues an int32 tensor; `data` (numel ints) must stay valid until write() returns.
  void add_i32(const std::string& name, std::vector<int64_t> shape, const int32_t* data);
  // Writes all tensors, in insertion order, to `path` atomically; Error on any failure.
  void write(const std::string& path) const;
  // Number of queued tensors.
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    const void* data;
    uint64_t nbytes;
  };
  void add(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data);

  std::map<std::string, std::string> metadata_;
  std::vector<Entry> entries_;
};

}  // namespace attnres
