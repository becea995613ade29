// Pieces of generated CUDA C++ text shared by the kernel printers (cuda_source.cpp): storage types,
// float conversions, pointer casts, loads and stores through the Params struct, float literals.
#pragma once

#include "ember/error.h"

#include <c10/core/ScalarType.h>

#include <cmath>
#include <cstdio>
#include <string>

namespace ember::cuda {

inline const char* storage_type(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat: return "float";
    case c10::kHalf:
    case c10::kBFloat16: return "unsigned short";
    case c10::kBool: return "unsigned char";
    default: break;
  }
  throw Error(std::string("CUDA fused kernel: unsupported dtype ") + c10::toString(t));
}

// Storage value `raw` as float, and float `v` as storage.
inline std::string to_float(c10::ScalarType t, const std::string& raw) {
  switch (t) {
    case c10::kHalf: return "h2f(" + raw + ")";
    case c10::kBFloat16: return "bf2f(" + raw + ")";
    case c10::kBool: return "(" + raw + " ? 1.f : 0.f)";
    default: return raw;
  }
}

inline std::string from_float(c10::ScalarType t, const std::string& v) {
  switch (t) {
    case c10::kHalf: return "f2h(" + v + ")";
    case c10::kBFloat16: return "f2bf(" + v + ")";
    case c10::kBool: return "(unsigned char)((" + v + ") != 0.f)";
    default: return v;
  }
}

inline std::string in_ptr(c10::ScalarType t, size_t input) {
  return "((const " + std::string(storage_type(t)) + "*)p.in[" + std::to_string(input) + "])";
}

inline std::string out_ptr(c10::ScalarType t, size_t output) {
  return "((" + std::string(storage_type(t)) + "*)p.out[" + std::to_string(output) + "])";
}

inline std::string load(c10::ScalarType t, size_t input, const std::string& offset) {
  return to_float(t, in_ptr(t, input) + "[" + offset + "]");
}

inline std::string store(c10::ScalarType t, size_t output, const std::string& index, const std::string& v) {
  return out_ptr(t, output) + "[" + index + "] = " + from_float(t, v) + ";";
}

inline std::string float_literal(float f) {
  if (f != f) return "__int_as_float(0x7fffffff)";
  if (f == INFINITY) return "__int_as_float(0x7f800000)";
  if (f == -INFINITY) return "__int_as_float(0xff800000)";
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%.9gf", f);
  std::string s = buf;
  if (s.find_first_of(".e") == std::string::npos) s.insert(s.size() - 1, ".0");
  return s;
}

// A string builder with stream syntax. iostreams are avoided on purpose: formatting integers through
// std::ostringstream crashed inside the Python process on the GPU machine (locale facets), while the
// same code ran in the C++ test binary.
struct Source {
  std::string s;
  Source& operator<<(const std::string& x) { s += x; return *this; }
  Source& operator<<(const char* x) { s += x; return *this; }
  Source& operator<<(size_t n) { s += std::to_string(n); return *this; }
  Source& operator<<(int n) { s += std::to_string(n); return *this; }
};

}  // namespace ember::cuda
