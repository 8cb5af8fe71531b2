#include "cli/device_options.hpp"

#include "attnres/error.hpp"
#include "backend/backend.hpp"

namespace attnres::cli {

void add_device_options(CLI::App* s, DeviceArgs& a) {
  s->add_option("--device", a.device,
                "Where the model runs: cpu, cuda, cuda-host (the CUDA kernels emulated on the "
                "CPU: slow, for tests)")
      ->check(CLI::IsMember({"cpu", "cuda", "cuda-host"}))
      ->capture_default_str();
  s->add_option("--precision", a.precision, "Matrix-product precision on a device: fp32 or bf16")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
}

std::shared_ptr<Backend> open_backend(const DeviceArgs& a) {
  check(a.precision == "fp32" || a.device != "cpu",
        "--precision bf16 runs on --device cuda or cuda-host; the CPU computes in fp32");
  std::shared_ptr<Backend> be = make_backend(a.device);
  be->set_matmul_precision(parse_precision(a.precision));
  return be;
}

}  // namespace attnres::cli
