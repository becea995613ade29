// The phases of a register-resident row kernel (cuda_source.cpp, rows_cached): one per reduction
// over the row, in code order, then one that writes the full outputs. Per phase, the full registers
// its columns need; per register, the phase (if any) that computes it once and keeps it for later
// phases, which then read it instead of recomputing it:
//  - as floats, a value whose recomputation costs a transcendental or a division (softmax's exp);
//  - packed two per register, a value rounded to bf16 (exact in 16 bits): the input it usually comes
//    from then frees, and later phases skip the rounding's integer work.
// Each kind holds at most `max_kept` registers' rows of values; the printer decides per variant
// whether they fit (KEEP, PACK) and otherwise recomputes, so `needed` always includes what
// recomputing takes.
#pragma once

#include "kernels/program.h"

#include <vector>

namespace ember::cuda {

bool is_row_reduction(OpCode op);

struct RowPhases {
  std::vector<int> targets;               // per phase: the register it reduces; -1: the output phase
  std::vector<std::vector<bool>> needed;  // [phase][register]
  std::vector<int> kept_in;               // [register]: the phase keeping it as floats; -1: none
  std::vector<int> packed_in;             // [register]: the phase keeping it as packed bf16; -1: none
};

RowPhases plan_row_phases(const Program& program, int max_kept);

}  // namespace ember::cuda
