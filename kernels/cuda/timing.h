// GPU timing shared by the tuned choices (kernels/cuda/gemm.cpp's GEMMs, launch_tuning.h's fused-kernel
// launches): built only against a CUDA torch (CUDA runtime events). Registers itself with launch_tuning.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace ember::cuda {

// Milliseconds per run of `launch` (which returns false, or throws, where it cannot run) on `stream` (a
// cudaStream_t); negative where it cannot run. Each run is timed alone, after a memset of `flush` (flush_bytes,
// twice the L2: l2_flush_bytes) has evicted its operands; the median of 5 to 10 runs. `give_up_ms` (>= 0): a
// candidate whose first run takes longer is not run again, its one run's time returned (it cannot win).
float time_runs(const std::function<bool()>& launch, void* stream, void* flush, size_t flush_bytes, float give_up_ms = -1.f);

// Twice `device`'s L2 (twice 64 MiB where CUDA cannot say): the bytes time_runs' flush overwrites.
int64_t l2_flush_bytes(int device);

// The device as a disk record's key names it: its name, architecture and SM count; "" where CUDA cannot say (no
// record is read or written then). Asked once per device.
std::string device_identity(int device);

}  // namespace ember::cuda
