// The boundary to oneDNN: plain C++ only (pointers, sizes, strides, enums), no ATen and no dnnl types.
//
// torch ships its own oneDNN headers (a different major version) under its include directory, so the one
// file that includes the system's dnnl.hpp (onednn.cpp) is built without torch's include paths, and the
// rest of ember talks to it through this header. Without oneDNN at build time, onednn_stub.cpp provides
// the same functions: available() is false and Matmul::create returns null.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ember::onednn {

// True when ember was built with oneDNN.
bool available();
// "oneDNN 2.6.3" or "not built".
std::string version();

enum class DType : uint8_t { F32, BF16 };

// One step of the epilogue, applied in order to the matmul's (biased) result.
struct PostOp {
  enum class Kind : uint8_t { Relu, GeluErf, GeluTanh, Silu, Sigmoid, Tanh, Hardswish, Clamp, Linear, Add };
  Kind kind = Kind::Relu;
  float alpha = 1.f, beta = 0.f;  // Linear: alpha * x + beta; Clamp: the bounds [alpha, beta]
  bool row = false;               // Add: the addend is one row [N] broadcast over every row
};

struct MatmulConfig {
  DType dtype = DType::F32;  // of source, weights, bias, addends and result alike
  bool bias = false;         // a [N] vector added to every row
  std::vector<PostOp> post_ops;
};

// One call's operands. A matrix element (i, j) lives at base[i * stride[0] + j * stride[1]], in elements.
struct MatmulCall {
  int64_t M = 0, N = 0, K = 0;
  const void* src = nullptr;  // [M, K]
  int64_t src_stride[2] = {0, 0};
  const void* weights = nullptr;  // [K, N]
  int64_t weights_stride[2] = {0, 0};
  const void* bias = nullptr;  // [N], contiguous
  void* dst = nullptr;         // [M, N], rows dst_stride apart, columns contiguous
  int64_t dst_stride = 0;
  std::vector<const void*> addends;       // one per Add post-op, in order
  std::vector<int64_t> addend_row_stride; // [M, N] addends: elements between rows (columns contiguous)
};

// dst = post_ops(src @ weights + bias), one oneDNN matmul primitive per distinct shape and stride pattern,
// created on first sight and kept. Weights can be packed once into oneDNN's blocked layout: a call with
// weights_generation != 0 promises that the weights are the same as in every other call with that
// generation, in this Matmul or any other (generations are process-wide: weights_generation() in
// epilogue_support.h), so they are reordered once per generation and layout, into a copy every Matmul reading
// them shares; generation 0 means "may change": the primitive reads them where they are.
class Matmul {
 public:
  // Null, with the reason in *why_not, when oneDNN is missing or rejects the configuration.
  static std::unique_ptr<Matmul> create(const MatmulConfig& config, std::string* why_not);
  virtual ~Matmul() = default;
  // Throws std::runtime_error when oneDNN cannot run this call (the caller falls back).
  virtual void run(const MatmulCall& call, uint64_t weights_generation) = 0;
  // How many distinct primitives (shapes) and weight packings were made so far.
  virtual size_t primitives() const = 0;
  virtual size_t packings() const = 0;
};

struct Conv2dConfig {
  DType dtype = DType::F32;
  bool bias = false;  // [OC]
  std::vector<PostOp> post_ops;  // Add addends have the result's sizes and strides
  int64_t stride[2] = {1, 1}, padding[2] = {0, 0}, dilation[2] = {1, 1}, groups = 1;
};

// One call's operands, 4-D tensors given by sizes and strides in elements (NCHW order, any layout:
// contiguous or channels-last).
struct Conv2dCall {
  int64_t src_sizes[4] = {}, src_strides[4] = {};
  int64_t weights_sizes[4] = {}, weights_strides[4] = {};  // [OC, IC / groups, KH, KW]
  int64_t dst_sizes[4] = {}, dst_strides[4] = {};
  const void* src = nullptr;
  const void* weights = nullptr;
  const void* bias = nullptr;
  void* dst = nullptr;
  std::vector<const void*> addends;  // laid out as dst
};

// dst = post_ops(conv2d(src, weights) + bias): one primitive per distinct shape and layout, weights packed
// once per generation as for Matmul.
class Conv2d {
 public:
  static std::unique_ptr<Conv2d> create(const Conv2dConfig& config, std::string* why_not);
  virtual ~Conv2d() = default;
  virtual void run(const Conv2dCall& call, uint64_t weights_generation) = 0;
};

}  // namespace ember::onednn
