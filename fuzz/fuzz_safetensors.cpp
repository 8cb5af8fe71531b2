// Fuzzes checkpoint loading: the safetensors header and body (every dtype), a model checkpoint
// (config JSON in __metadata__, tensors checked against it) and optimizer state.
#include <cstdlib>
#include <memory>

#include "attnres/checkpoint.hpp"
#include "attnres/error.hpp"
#include "fuzz_util.hpp"

using namespace attnres;

namespace {

// The model fuzz_make_seeds saves (its optimizer seed loads into this).
struct Tiny {
  Model model;
  AdamW opt;
  Tiny() : model(fuzz::tiny_model_config()), opt(model.layout(), AdamWConfig{}) {}
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Tiny* tiny = new Tiny();  // NOLINT: lives for the whole process
  const std::string path = fuzz::write_scratch("input.safetensors", data, size);

  // 1. The generic reader: every tensor read as its dtype allows.
  try {
    SafetensorsReader r = SafetensorsReader::open(path);
    for (const std::string& n : r.names()) {
      const TensorInfo& ti = r.info(n);
      try {
        if (ti.dtype == DType::I32 || ti.dtype == DType::I64) {
          if (r.read_i32(n).size() != static_cast<size_t>(ti.numel())) std::abort();
        } else {
          if (r.read_f32(n).size() != static_cast<size_t>(ti.numel())) std::abort();
        }
      } catch (const Error&) {
      }
    }
    try {
      r.info("no.such.tensor");
      std::abort();  // a missing name must throw
    } catch (const Error&) {
    }
  } catch (const Error&) {
  }

  // 2. As a model checkpoint (context capped: the RoPE tables are sized from it, not the file).
  try {
    Metadata meta;
    std::unique_ptr<Model> m = load_model(path, &meta, 16);
  } catch (const Error&) {
  }

  // 3. As the optimizer state of a fixed small model.
  try {
    load_optimizer(path, tiny->model, tiny->opt);
  } catch (const Error&) {
  }
  return 0;
}
