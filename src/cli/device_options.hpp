// The --device and --precision options of the commands that run a model (eval, generate, bench;
// train and compare have them as TrainConfig fields).
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "attnres/backend.hpp"

namespace attnres::cli {

struct DeviceArgs {
  Device device = Device::cpu;
  MatmulPrecision precision = MatmulPrecision::fp32;
};

// Registers --device and --precision on s, bound to a.
void add_device_options(CLI::App* s, DeviceArgs& a);

// The backend a names, at its precision. Throws Error for bf16 on the CPU or a device this build
// or machine lacks.
std::shared_ptr<Backend> open_backend(const DeviceArgs& a);

}  // namespace attnres::cli
