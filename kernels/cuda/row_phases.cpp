// The phases of a register-resident row kernel (row_phases.h).
#include "kernels/cuda/row_phases.h"

namespace ember::cuda {
namespace {

// Operations that cost far more to recompute than a kept value costs to read: transcendentals and
// IEEE division.
bool costly(OpCode op) {
  switch (op) {
    case OpCode::Exp: case OpCode::Log: case OpCode::Log1p: case OpCode::Expm1: case OpCode::Sin: case OpCode::Cos:
    case OpCode::Tanh: case OpCode::Sigmoid: case OpCode::Erf: case OpCode::Gelu: case OpCode::GeluTanh:
    case OpCode::Silu: case OpCode::Div: case OpCode::Reciprocal: case OpCode::Pow: case OpCode::GeluBackward:
      return true;
    default: return false;
  }
}

}  // namespace

bool is_row_reduction(OpCode op) {
  return op == OpCode::RowSum || op == OpCode::RowMean || op == OpCode::RowMax || op == OpCode::RowMin;
}

RowPhases plan_row_phases(const Program& p, int max_kept) {
  const size_t regs = p.reg_is_row.size();
  std::vector<int> def(regs, -1);
  for (size_t n = 0; n < p.code.size(); ++n) def[p.code[n].dst] = static_cast<int>(n);
  RowPhases ph;
  ph.kept_in.assign(regs, -1);
  ph.packed_in.assign(regs, -1);
  std::vector<std::vector<int>> roots;
  for (const Instr& i : p.code)
    if (p.reg_is_row[i.dst] && is_row_reduction(i.op) && i.a.kind == Operand::Kind::Reg) {
      ph.targets.push_back(i.a.index);
      roots.push_back({i.a.index});
    } else if (p.reg_is_row[i.dst] && is_row_reduction(i.op)) {
      ph.targets.push_back(-1);
      roots.push_back({});
    }
  std::vector<int> outs;
  for (const ProgramOutput& out : p.outputs)
    if (!out.row) outs.push_back(out.reg);
  if (!outs.empty()) {
    ph.targets.push_back(-1);
    roots.push_back(outs);
  }
  // The full registers a phase needs, down to inputs and row registers; below a register in `stop`,
  // nothing (a packed value read back: what it was computed from is not needed again).
  auto closure = [&](const std::vector<int>& from, const std::vector<bool>* stop) {
    std::vector<bool> need(regs, false);
    std::vector<int> work = from;
    while (!work.empty()) {
      int r = work.back();
      work.pop_back();
      if (r < 0 || static_cast<size_t>(r) >= regs || need[r] || p.reg_is_row[r]) continue;
      need[r] = true;
      if (def[r] < 0 || (stop && (*stop)[r])) continue;
      for (const Operand* a : {&p.code[def[r]].a, &p.code[def[r]].b, &p.code[def[r]].c})
        if (a->kind == Operand::Kind::Reg) work.push_back(a->index);
    }
    return need;
  };
  for (const std::vector<int>& r : roots) ph.needed.push_back(closure(r, nullptr));
  // A value rounded to bf16 is exact in 16 bits: kept packed, it costs what the input it usually
  // comes from costs (which then frees), and spares later phases the rounding's integer work.
  int packed_rows = 0;
  for (size_t q = 0; q < roots.size(); ++q)
    for (size_t r = 0; r < regs; ++r) {
      if (!ph.needed[q][r] || ph.packed_in[r] >= 0 || def[r] < 0 || p.code[def[r]].op != OpCode::RoundBFloat16) continue;
      bool later = false;
      for (size_t l = q + 1; l < roots.size(); ++l) later |= ph.needed[l][r];
      if (!later || packed_rows == max_kept) continue;
      ph.packed_in[r] = static_cast<int>(q);
      ++packed_rows;
    }
  // What a later phase reads of an earlier one's values where the packed ones are read back: a value
  // that only a packed one needs (softmax(x / d)'s quotient, under its rounding) is not worth keeping.
  std::vector<std::vector<bool>> reads(roots.size());
  for (size_t l = 0; l < roots.size(); ++l) {
    std::vector<bool> stop(regs, false);
    for (size_t r = 0; r < regs; ++r) stop[r] = ph.packed_in[r] >= 0 && ph.packed_in[r] < static_cast<int>(l);
    reads[l] = closure(roots[l], &stop);
  }
  int kept_rows = 0;
  for (size_t q = 0; q < roots.size(); ++q)
    for (size_t r = 0; r < regs; ++r) {
      if (!ph.needed[q][r] || ph.kept_in[r] >= 0 || ph.packed_in[r] >= 0 || def[r] < 0 || !costly(p.code[def[r]].op)) continue;
      bool later = false;
      for (size_t l = q + 1; l < roots.size(); ++l) later |= reads[l][r];
      if (!later || kept_rows == max_kept) continue;
      ph.kept_in[r] = static_cast<int>(q);
      ++kept_rows;
    }
  return ph;
}

}  // namespace ember::cuda
