// Deployment without Python: load a package that ember.export wrote and run it.
//
//   #include <ember/model.h>
//   ember::Model model = ember::load("model.ember", at::kCUDA);
//   std::vector<at::Tensor> out = model.run({x});
//
// A package holds the model's IR, its weights, its compiled CUDA kernels and a description of its
// inputs. load() verifies the file (checksum, format version, device and GPU architecture) and
// compiles the IR with the package's kernel images, so no NVRTC and no Python are needed. Every
// problem with the file or with the inputs of a run is an ember::Error with a message that says what
// is wrong.
#pragma once

#include "ember/error.h"
#include "ember/ir.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace ember {

struct LoadOptions {
  // Off only to fuzz the parser: without it a damaged file is not detected.
  bool verify_checksum = true;
  // mode="reduce-overhead" for deployment: the plan's CUDA parts are captured into CUDA graphs after a
  // warm-up call and replayed (cudagraph/); calls from several threads are serialized per device.
  // CUDA devices only; a libember built against a torch without CUDA throws.
  bool reduce_overhead = false;
};

// One input or output: its name in the graph and its type. Sizes may be symbolic ("s0"); a symbol
// takes the same value wherever it appears in one call.
struct TensorSpec {
  std::string name;
  TensorType type;
  std::string str() const;  // "x: f32[s0, 16]@cpu"
};

// The values a symbolic size may take (from torch.export's dynamic_shapes); max -1 is unbounded.
struct SymbolRange {
  std::string name;
  int64_t min = 0, max = -1;
  int64_t example = 1;  // its value in the example inputs of the export
};

// A loaded package. A cheap handle: copies share one compiled model and its weights.
class Model {
 public:
  // Checks `inputs` against the input specs (count, dtype, device, rank, sizes, symbols consistent
  // and in range; throws ember::Error naming the input and dimension otherwise), makes non-contiguous
  // inputs contiguous, and runs the compiled plan. Safe to call from several threads at once.
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) const;

  const std::vector<TensorSpec>& inputs() const;
  const std::vector<TensorSpec>& outputs() const;
  const std::vector<SymbolRange>& symbols() const;
  c10::Device device() const;
  // The package's meta lines (ember, torch and CUDA versions, device, architecture, ...).
  const std::vector<std::pair<std::string, std::string>>& metadata() const;
  // What the compiled plan runs, one line per step.
  std::string describe() const;

  struct State;  // defined in backend/package/model.cpp

 private:
  friend Model load(const std::string&, c10::Device, const LoadOptions&);
  friend Model load_from_memory(std::shared_ptr<const void>, size_t, c10::Device, const LoadOptions&);
  explicit Model(std::shared_ptr<const State> state) : state_(std::move(state)) {}
  std::shared_ptr<const State> state_;
};

// Loads the package at `path` for `device` (the device kind it was exported for; another index of the
// same kind is fine). The file is memory-mapped: CPU weights are read straight from the mapping.
Model load(const std::string& path, c10::Device device = c10::kCPU, const LoadOptions& options = {});

// The same from bytes in memory that `owner` keeps alive (owner.get() points at the first byte).
Model load_from_memory(std::shared_ptr<const void> owner, size_t size, c10::Device device = c10::kCPU,
                       const LoadOptions& options = {});

}  // namespace ember
