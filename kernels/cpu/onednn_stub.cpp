// Built instead of onednn.cpp when CMake finds no oneDNN: every matmul group then runs through ATen.
#include "kernels/cpu/onednn.h"

namespace ember::onednn {

bool available() { return false; }

std::string version() { return "not built"; }

std::unique_ptr<Matmul> Matmul::create(const MatmulConfig&, std::string* why_not) {
  if (why_not) *why_not = "ember was built without oneDNN";
  return nullptr;
}

std::unique_ptr<Conv2d> Conv2d::create(const Conv2dConfig&, std::string* why_not) {
  if (why_not) *why_not = "ember was built without oneDNN";
  return nullptr;
}

}  // namespace ember::onednn
