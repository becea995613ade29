// ember::embedding_grad: an embedding's weight gradient as a fresh zero table plus one index_add_ of the
// gradient rows, which ATen's CUDA kernel adds with atomics (decompositions.py puts it in place of
// aten::embedding_dense_backward without scale_grad_by_freq: for CUDA graphs outside deterministic mode, for
// float32 and float64 CPU ones always, the CPU's index_add_ adding in index order).
//  1. Why: ATen's embedding_dense_backward sorts the indices and walks their runs. In BERT-base's training
//     step (H100, 8x128 tokens) its three calls took 116 us of GPU time besides the 30 us zero fill of the
//     30522 x 768 word table; the index_adds take ~15 us. The order of the additions into one row then varies
//     from run to run, as with inductor's atomic adds.
//  2. As one op: written as zeros + index_add in the decomposition, functionalization makes the index_add
//     out of place, and ATen's out-of-place index_add copies the whole zero table first (63 us there).
//  3. Rows whose index is padding_idx add nothing (ATen's rule); 16-bit gradients accumulate in f32 and are
//     rounded once at the end, as ATen's kernel accumulates.
//  4. On the CPU (float32 and float64 tables, decompositions.py) the zero table is fresh anonymous memory in
//     huge pages (Linux), which reads as zero and costs a page only where a row is written: at::zeros writes
//     every page. BERT-base's word table (30522 x 768 floats, 94 MB) with 64 rows added took 17.8 ms through
//     at::zeros on the 2-core host (113-115 ms per fill_ inside its profiled training step), in eager as under
//     ember, nearly all page faults; 6.2 ms so. The additions are ATen's CPU index_add_, in index order.
#include <ATen/ops/from_blob.h>
#include <ATen/ops/index_add.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <utility>

#ifdef __linux__
#include <sys/mman.h>

#include <fstream>
#include <iterator>
#include <string>
#define EMBER_FRESH_PAGES 1
#endif

namespace ember {
namespace {

// Tables smaller than this are filled by at::zeros: a mapping of their own costs a system call each way.
constexpr int64_t kFreshPagesBytes = int64_t{1} << 20;

#ifdef EMBER_FRESH_PAGES
// Whether Linux gives transparent huge pages to a mapping that asks for them ("always" or "madvise").
bool huge_pages_on_request() {
  static const bool on = [] {
    std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
    const std::string mode((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    return mode.find("[always]") != std::string::npos || mode.find("[madvise]") != std::string::npos;
  }();
  return on;
}
#endif

// A zero CPU tensor in fresh anonymous huge pages (item 4), or at::zeros where it is small or they are not had.
// Huge pages, because a later write of the whole table (clip_grad_norm_'s multiply) into 4 KB pages that a read
// mapped to the zero page first faults twice per page: BERT-base's word table, 64 rows added, then a norm and
// a mul_, took 268 ms so against 31 ms from at::zeros (2-core host); in huge pages 23 ms, the rows alone 6.2
// against 17.8.
at::Tensor zeros_cpu(int64_t rows, int64_t width, const at::TensorOptions& options) {
#ifdef EMBER_FRESH_PAGES
  const c10::ScalarType dtype = c10::typeMetaToScalarType(options.dtype());
  const int64_t bytes = rows * width * static_cast<int64_t>(c10::elementSize(dtype));
  if (bytes >= kFreshPagesBytes && huge_pages_on_request()) {
    const size_t size = static_cast<size_t>(bytes);
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) {
      if (madvise(p, size, MADV_HUGEPAGE) == 0)
        return at::from_blob(p, {rows, width}, [size](void* q) { munmap(q, size); }, options);
      munmap(p, size);
    }
  }
#endif
  return at::zeros({rows, width}, options);
}

// The gradient as rows, one per index, those of padding_idx zeroed (ATen's rule), and the indices flat.
std::pair<at::Tensor, at::Tensor> gradient_rows(const at::Tensor& grad, const at::Tensor& indices,
                                                int64_t padding_idx) {
  at::Tensor flat = indices.reshape({-1});
  at::Tensor rows = grad.reshape_symint({flat.sym_size(0), grad.sym_size(-1)});
  if (padding_idx >= 0) rows = rows.masked_fill(flat.eq(padding_idx).unsqueeze(1), 0);
  return {std::move(rows), std::move(flat)};
}

at::Tensor embedding_grad(const at::Tensor& grad, const at::Tensor& indices, c10::SymInt num_weights,
                          int64_t padding_idx) {
  auto [rows, flat] = gradient_rows(grad, indices, padding_idx);
  const bool narrow = grad.scalar_type() == at::kHalf || grad.scalar_type() == at::kBFloat16;
  if (narrow) rows = rows.to(at::kFloat);
  at::Tensor out = at::zeros_symint({std::move(num_weights), grad.sym_size(-1)}, rows.options());
  out.index_add_(0, flat, rows);
  return narrow ? out.to(grad.scalar_type()) : out;
}

// Real CPU tensors (fake and meta ones take the function above): float32 and float64 gradients into a table of
// fresh pages.
at::Tensor embedding_grad_cpu(const at::Tensor& grad, const at::Tensor& indices, c10::SymInt num_weights,
                              int64_t padding_idx) {
  if (grad.scalar_type() != at::kFloat && grad.scalar_type() != at::kDouble)
    return embedding_grad(grad, indices, std::move(num_weights), padding_idx);
  const auto [rows, flat] = gradient_rows(grad, indices, padding_idx);
  at::Tensor out = zeros_cpu(num_weights.expect_int(), grad.size(-1), rows.options());
  out.index_add_(0, flat, rows);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def("embedding_grad(Tensor grad, Tensor indices, SymInt num_weights, int padding_idx) -> Tensor");
}

TORCH_LIBRARY_IMPL(ember, CompositeExplicitAutograd, m) { m.impl("embedding_grad", &embedding_grad); }
TORCH_LIBRARY_IMPL(ember, CPU, m) { m.impl("embedding_grad", &embedding_grad_cpu); }

}  // namespace ember
