// NVRTC compilation and kernel launches through the CUDA driver API, loaded lazily (see driver.cpp).
#pragma once

#include <string>

namespace ember::cuda {

// True when the driver and NVRTC load; otherwise false with the reason.
bool available(std::string* why_not);

// Compiles `source` for `device`'s architecture and returns the CUfunction named `name`. Identical
// sources compile once per process. Throws ember::Error with NVRTC's log on failure.
void* compile(const std::string& source, const std::string& name, int device);

// Launches `function` with one by-value struct argument `params` on `stream` (a CUstream).
void launch(void* function, unsigned blocks, unsigned threads, void* stream, void* params, int device);

}  // namespace ember::cuda
