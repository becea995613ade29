// A fusion group lowered to a device-independent Program: straight-line instructions over float
// registers. Both kernel generators start here: kernels/cpu interprets it over blocks of elements,
// kernels/cuda (to come) prints it as CUDA C++.
//
// The iteration space is the group's "full" shape. A Full register holds one value per element; a Row
// register (only in groups with a reduction) holds one value per row, a row being the last dimension.
// In a group that reduces its `outer` leading dimensions instead (a bias gradient: a sum over the batch),
// a Row register holds one value per position of the remaining dimensions: a column of the
// [reduced, kept] matrix. There no Full value depends on a Row value (nothing broadcasts back).
// Every value is computed in float32 whatever its storage dtype; loads and stores convert.
#pragma once

#include "ember/ir.h"

#include <optional>
#include <string>
#include <vector>

namespace ember {

enum class OpCode : uint8_t {
  // unary
  Copy, Neg, Exp, Log, Log1p, Expm1, Sin, Cos, Tanh, Sigmoid, Relu, Sqrt, Rsqrt, Abs, Reciprocal, Erf,
  RoundHalf, RoundBFloat16, ToBool, Gelu, GeluTanh, Silu,
  // binary
  Add, Sub, Mul, Div, Max, Min, Pow, Gt, Lt, Ge, Le, Eq, Ne, GeluBackward,
  // ternary: a != 0 ? b : c;  a * b + c
  Where, MulAdd,
  // reductions over a row: Full -> Row
  RowSum, RowMean, RowMax, RowMin,
};

const char* opcode_name(OpCode op);

struct Operand {
  enum class Kind : uint8_t { None, Reg, Imm, Scalar };
  Kind kind = Kind::None;
  int index = 0;    // register (Reg) or runtime scalar (Scalar)
  float imm = 0.f;  // Imm

  static Operand reg(int r) { return {Kind::Reg, r, 0.f}; }
  static Operand constant(float v) { return {Kind::Imm, 0, v}; }
  static Operand scalar(int s) { return {Kind::Scalar, s, 0.f}; }
};

struct Instr {
  OpCode op;
  int dst;
  Operand a, b, c;
};

struct ProgramInput {
  const Value* value;
  bool row;  // broadcast to the row shape rather than the full shape
  int reg;
};

struct ProgramOutput {
  const Value* value;
  int reg;
  bool row;      // one value per row
  bool keepdim;  // row outputs: stored as [..., 1] rather than [...]
};

struct Program {
  int group = -1;
  c10::Device device{c10::kCPU};
  size_t rank = 0;               // rank of the full shape
  bool has_reduction = false;
  size_t outer = 0;              // > 0: the reductions are over the first `outer` dims (columns), not rows
  std::vector<bool> reg_is_row;  // per register
  std::vector<ProgramInput> inputs;
  std::vector<const Value*> scalars;  // int/float values read from buffers on each call
  std::vector<Instr> code;
  std::vector<ProgramOutput> outputs;
  std::vector<const Node*> members;

  // Readable listing, for debug dumps and explain.
  std::string text() const;
};

// Lowers fusion group `group` of `graph`. Returns nothing, with the reason in *why_not, when some
// member has no lowering (the group's nodes then run through ATen).
std::optional<Program> lower_group(const Graph& graph, int group, std::string* why_not);

}  // namespace ember
