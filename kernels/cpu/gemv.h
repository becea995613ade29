// The CPU matmul for a few rows (kernels/cpu/gemv.cpp): plain C++, the call described as for oneDNN.
#pragma once

#include "kernels/cpu/onednn.h"

namespace ember::cpu {

using onednn::MatmulCall;
using onednn::MatmulConfig;
using onednn::PostOp;

// True when gemv() runs this float32 call: this CPU has AVX2 and FMA, source rows and weight columns are
// contiguous (weights_stride[0] == 1: nn.Linear's weight, transposed), no dimension is empty.
bool gemv_takes(const MatmulCall& call);

// dst = post_ops(src @ weights + bias), float32, every operand as gemv_takes describes; dst columns
// contiguous. Meant for a few rows: it streams the weights once per 2-4 rows.
void gemv(const MatmulConfig& config, const MatmulCall& call);

namespace avx2 {
void gemv(const MatmulConfig& config, const MatmulCall& call);
}
namespace avx512 {
void gemv(const MatmulConfig& config, const MatmulCall& call);
}

}  // namespace ember::cpu
