// attnres/cuda.hpp — the CUDA backend (built with -DATTNRES_CUDA=ON; sm_90 + PTX): what this build
// and this machine offer. The device kernels and their tests live in src/cuda and
// tests/test_cuda.cpp; the model does not run on the GPU yet (see README, "CUDA backend").
#pragma once

#include <string>

namespace attnres::cuda {

// True when this build has the CUDA backend.
bool compiled();

// Number of usable CUDA devices. 0 when there is none, with the reason in *why (built without
// CUDA, no driver, a driver too old for the runtime, no device).
int device_count(std::string* why = nullptr);

// "NVIDIA H200, sm_90, 132 SMs, 139.8 GiB; driver 13.0, runtime 13.0" for device `dev`; the
// reason when there is none.
std::string describe_device(int dev = 0);

}  // namespace attnres::cuda
