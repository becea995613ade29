// A fused CUDA kernel: the group's module (cuda_source.h), compiled with NVRTC when the plan is built,
// launched on ATen's current stream. Each call picks its entry point from cheap facts about the call:
// flat groups take the 16-byte vector kernel when outputs are aligned (inputs that are contiguous and
// aligned get vector loads, the others strided ones); row groups take the register-resident variant
// for their row length, or the general kernel for long rows. Grids are sized to fill the device
// (multiprocessor count queried once), with grid-stride loops doing the rest.
#include "kernels/cuda/cuda_kernel.h"

#include "ember/error.h"
#include "kernels/cuda/cuda_source.h"
#include "kernels/cuda/driver.h"
#include "kernels/iteration_space.h"

#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cstring>

namespace ember::cuda {
namespace {

constexpr unsigned kThreads = 256;
constexpr int64_t kBlocksPerMultiprocessor = 8;  // 8 x 256 threads: a full H100/H200 multiprocessor

bool aligned(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

class FusedCudaKernel final : public Kernel {
 public:
  FusedCudaKernel(Program program, CudaSource source, std::vector<void*> functions, int device)
      : p_(std::move(program)), source_(std::move(source)), functions_(std::move(functions)), device_(device) {
    for (const ProgramOutput& o : p_.outputs) out_dtypes_.push_back(o.value->type.tensor.dtype);
    max_blocks_ = std::max<int64_t>(1, multiprocessor_count(device_) * kBlocksPerMultiprocessor);
    for (size_t i = 0; i < source_.rows.size(); ++i) row_max_threads_.push_back(max_threads_per_block(functions_[1 + i]));
  }

  std::string describe() const override {
    return "cuda fused group " + std::to_string(p_.group) + " (" + std::to_string(p_.code.size()) +
           " instructions" + (p_.has_reduction ? ", row reductions" : "") + ")";
  }

  void run(std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
           const std::vector<uint32_t>& writes) const override {
    const size_t ni = p_.inputs.size(), no = p_.outputs.size(), rank = std::max<size_t>(p_.rank, 1);
    const IterationSpace space = iteration_space(p_, buffers, reads);
    const std::vector<int64_t>& full = space.full;
    const int64_t numel = space.numel, rows = space.rows, cols = space.cols;
    const int width = source_.vector_width;
    c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_));
    c10::DeviceGuard guard(device);

    // Params, laid out as the printed struct.
    const size_t in_words = std::max<size_t>(ni, 1), out_words = std::max<size_t>(no, 1);
    std::vector<int64_t> words(in_words + out_words + rank + in_words * rank + 5 + in_words +
                               (std::max<size_t>(p_.scalars.size(), 1) + 1) / 2, 0);
    const size_t stride_base = in_words + out_words + rank;
    size_t w = 0;
    for (size_t k = 0; k < in_words; ++k, ++w)
      if (k < ni) {
        const void* ptr = buffers[reads[k]].toTensor().data_ptr();
        std::memcpy(&words[w], &ptr, sizeof(ptr));
      }
    std::vector<at::Tensor> outs;
    outs.reserve(no);
    bool outputs_aligned = true;
    for (size_t k = 0; k < out_words; ++k, ++w)
      if (k < no) {
        outs.push_back(at::empty(output_shape(p_.outputs[k], full, p_.has_reduction),
                                 at::TensorOptions().device(device).dtype(out_dtypes_[k])));
        void* ptr = outs.back().data_ptr();
        outputs_aligned &= aligned(ptr, width * c10::elementSize(out_dtypes_[k]));
        std::memcpy(&words[w], &ptr, sizeof(ptr));
      }
    for (size_t d = 0; d < rank; ++d) words[w++] = d < full.size() ? full[d] : 1;
    for (size_t k = 0; k < in_words; ++k, w += rank)
      if (k < ni) aligned_strides(buffers[reads[k]].toTensor(), p_.inputs[k].row ? space.row_shape : full, &words[w]);
    words[w++] = numel;
    words[w++] = rows;
    words[w++] = cols;
    uint32_t masks[4] = {0, 0, 0, 0};  // vec, bcast, inner, unused
    int64_t* period = &words[w + 2];
    for (size_t k = 0; k < ni && k < static_cast<size_t>(kMaxVectorInputs); ++k) {
      if (p_.inputs[k].row) continue;
      const at::Tensor& t = buffers[reads[k]].toTensor();
      const int64_t* stride = &words[stride_base + k * rank];
      const bool vector_aligned = aligned(t.data_ptr(), width * t.element_size());
      if (vector_aligned && (p_.has_reduction ? row_vectorizable(stride, full, cols, width) : contiguous(stride, full)))
        masks[0] |= 1u << k;
      else if (one_value(stride, full))
        masks[1] |= 1u << k;
      else if (!p_.has_reduction && vector_aligned && (period[k] = repeat_period(stride, full)) > 0 && period[k] % width == 0)
        masks[2] |= 1u << k;
    }
    if (outputs_aligned && (!p_.has_reduction || cols % width == 0)) masks[0] |= kVectorOutputs;
    std::memcpy(&words[w], masks, sizeof(masks));
    w += 2 + in_words;
    float* scalars = reinterpret_cast<float*>(&words[w]);
    for (size_t s = 0; s < p_.scalars.size(); ++s) {
      const c10::IValue& v = buffers[reads[ni + s]];
      scalars[s] = v.isDouble() ? static_cast<float>(v.toDouble()) : v.isBool() ? float(v.toBool()) : float(v.toInt());
    }

    if (numel > 0 || (p_.has_reduction && rows > 0)) {
      void* stream = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(device).native_handle();
      Launch l = p_.has_reduction ? row_launch(rows, cols) : flat_launch(numel, masks[0]);
      launch(l.function, l.blocks, l.threads, stream, words.data(), device_);
    }
    for (size_t k = 0; k < no; ++k) buffers[writes[k]] = std::move(outs[k]);
  }

 private:
  struct Launch {
    void* function;
    unsigned blocks, threads;
  };

  unsigned blocks_for(int64_t work_items, int64_t per_block) const {
    return static_cast<unsigned>(std::clamp<int64_t>((work_items + per_block - 1) / per_block, 1, max_blocks_));
  }

  // Every aligned stride 0 (or its dimension of size 1): one value for all elements.
  static bool one_value(const int64_t* stride, const std::vector<int64_t>& full) {
    for (size_t d = 0; d < full.size(); ++d)
      if (stride[d] != 0 && full[d] != 1) return false;
    return true;
  }

  // Contiguous over the trailing dimensions and broadcast (stride 0) over the leading ones: the number
  // of elements after which the input repeats; 0 where it does not have that form.
  static int64_t repeat_period(const int64_t* stride, const std::vector<int64_t>& full) {
    int64_t period = 1;
    size_t d = full.size();
    for (; d-- > 0;) {
      if (full[d] == 1) continue;
      if (stride[d] != period) break;
      period *= full[d];
    }
    for (d = d + 1; d-- > 0;)
      if (full[d] != 1 && stride[d] != 0) return 0;
    return period;
  }

  // Contiguous in the iteration space (row-major over the full shape; size-1 dims take any stride).
  static bool contiguous(const int64_t* stride, const std::vector<int64_t>& full) {
    int64_t expected = 1;
    for (size_t d = full.size(); d-- > 0;) {
      if (full[d] == 1) continue;
      if (stride[d] != expected) return false;
      expected *= full[d];
    }
    return true;
  }

  // Row groups: every row's columns contiguous and every row start aligned to the vector width.
  static bool row_vectorizable(const int64_t* stride, const std::vector<int64_t>& full, int64_t cols, int width) {
    if (full.empty() || cols % width != 0 || (cols > 1 && stride[full.size() - 1] != 1)) return false;
    for (size_t d = 0; d + 1 < full.size(); ++d)
      if (stride[d] % width != 0) return false;
    return true;
  }

  Launch flat_launch(int64_t numel, uint32_t vec) const {
    const int64_t width = source_.vector_width;
    // The vector kernel needs aligned outputs; below one vector it would run only its tail.
    if ((vec & kVectorOutputs) && numel >= width) return {functions_[1], blocks_for(numel / width, kThreads), kThreads};
    return {functions_[0], blocks_for(numel, kThreads), kThreads};
  }

  Launch row_launch(int64_t rows, int64_t cols) const {
    const int width = source_.vector_width;
    auto launchable = [&](const RowVariant& v) {
      int64_t most = row_max_threads_[variant_index(v)];
      return v.mode == RowVariant::Mode::Warp ? most >= 32 : block_threads(v, cols, width) <= most;
    };
    std::optional<RowVariant> v = choose_row_variant(cols, width, source_.rows, launchable);
    if (!v) {
      unsigned threads = cols <= 64 ? 64 : (cols <= 512 ? 128 : 256);
      return {functions_[0], static_cast<unsigned>(std::min<int64_t>(rows, max_blocks_ * (kThreads / threads))), threads};
    }
    const size_t index = variant_index(*v);
    void* function = functions_[1 + index];
    if (v->mode == RowVariant::Mode::Warp) {
      const unsigned threads = static_cast<unsigned>(std::min<int64_t>(kThreads, row_max_threads_[index] / 32 * 32));
      return {function, blocks_for(rows, threads / 32), threads};
    }
    const int64_t threads = std::max<int64_t>(block_threads(*v, cols, width), 32);
    const int64_t blocks = std::clamp<int64_t>(max_blocks_ * kThreads / threads, 1, rows);
    return {function, static_cast<unsigned>(blocks), static_cast<unsigned>(threads)};
  }

  size_t variant_index(const RowVariant& v) const {
    for (size_t i = 0; i < source_.rows.size(); ++i)
      if (source_.rows[i].entry == v.entry) return i;
    throw Error("CUDA fused kernel: row variant " + v.entry + " not compiled");
  }

  Program p_;
  CudaSource source_;
  std::vector<void*> functions_;  // general, then the vector kernel (flat) or the row variants in order
  int device_;
  int64_t max_blocks_ = 1;
  std::vector<int64_t> row_max_threads_;  // per row variant: its registers bound its block
  std::vector<c10::ScalarType> out_dtypes_;
};

}  // namespace

std::shared_ptr<const Kernel> make_fused_kernel(Program program, std::string* listing, std::string* why_not,
                                                ImageStore* images) {
  if (!available(why_not)) return nullptr;
  int device = program.device.has_index() ? program.device.index() : 0;
  // One name for every kernel: the source then depends on the program alone, so identical groups (a
  // transformer's repeated layers) share one compiled module.
  CudaSource source = generate(program, "ember_fused");
  if (listing) *listing += "// group " + std::to_string(program.group) + "\n" + source.text + "\n";
  std::vector<std::string> entries{source.general};
  if (!source.vector_entry.empty()) entries.push_back(source.vector_entry);
  for (const RowVariant& v : source.rows) entries.push_back(v.entry);
  std::vector<void*> functions = compile(source.text, entries, device, images);
  return std::make_shared<FusedCudaKernel>(std::move(program), std::move(source), std::move(functions), device);
}

}  // namespace ember::cuda
