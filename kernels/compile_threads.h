// How many kernels compile at once: code generation's threads, and NVRTC compiles in the process (driver.cpp).
#pragma once

#include <cstddef>

namespace ember {

// EMBER_COMPILE_THREADS, else the hardware's threads (read once).
size_t compile_threads();

}  // namespace ember
