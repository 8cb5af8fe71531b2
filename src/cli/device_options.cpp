#include "cli/device_options.hpp"

#include "attnres/error.hpp"
#include "backend/backend.hpp"
#include "cli/enum_option.hpp"

namespace attnres::cli {

void add_device_options(CLI::App* s, DeviceArgs& a) {
  add_enum_option(s, "--device", a.device, parse_device,
                  "Where the model runs: cpu, cuda, cuda-host (the CUDA kernels emulated on the "
                  "CPU: slow, for tests)",
                  {"cpu", "cuda", "cuda-host"});
  add_enum_option(s, "--precision", a.precision, parse_precision,
                  "Matrix-product precision: fp32, or bf16 (bf16 operands, fp32 sums; on the CPU "
                  "the linear layers, fastest with AVX512-BF16 or AMX)",
                  {"fp32", "bf16"});
}

std::shared_ptr<Backend> open_backend(const DeviceArgs& a) {
  return make_backend(a.device, a.precision);
}

}  // namespace attnres::cli
