// ember::embedding_grad: an embedding's weight gradient as a fresh zero table plus one index_add_ of the
// gradient rows, which ATen's CUDA kernel adds with atomics (decompositions.py puts it in place of
// aten::embedding_dense_backward for CUDA graphs, outside deterministic mode, without scale_grad_by_freq).
//  1. Why: ATen's embedding_dense_backward sorts the indices and walks their runs. In BERT-base's training
//     step (H100, 8x128 tokens) its three calls took 116 us of GPU time besides the 30 us zero fill of the
//     30522 x 768 word table; the index_adds take ~15 us. The order of the additions into one row then varies
//     from run to run, as with inductor's atomic adds.
//  2. As one op: written as zeros + index_add in the decomposition, functionalization makes the index_add
//     out of place, and ATen's out-of-place index_add copies the whole zero table first (63 us there).
//  3. Rows whose index is padding_idx add nothing (ATen's rule); 16-bit gradients accumulate in f32 and are
//     rounded once at the end, as ATen's kernel accumulates.
#include <ATen/ops/index_add.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

namespace ember {
namespace {

at::Tensor embedding_grad(const at::Tensor& grad, const at::Tensor& indices, c10::SymInt num_weights,
                          int64_t padding_idx) {
  const c10::SymInt width = grad.sym_size(-1);
  const at::Tensor flat = indices.reshape({-1});
  at::Tensor rows = grad.reshape_symint({flat.sym_size(0), width});
  if (padding_idx >= 0) rows = rows.masked_fill(flat.eq(padding_idx).unsqueeze(1), 0);
  const bool narrow = grad.scalar_type() == at::kHalf || grad.scalar_type() == at::kBFloat16;
  if (narrow) rows = rows.to(at::kFloat);
  at::Tensor out = at::zeros_symint({std::move(num_weights), width}, rows.options());
  out.index_add_(0, flat, rows);
  return narrow ? out.to(grad.scalar_type()) : out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def("embedding_grad(Tensor grad, Tensor indices, SymInt num_weights, int padding_idx) -> Tensor");
}

TORCH_LIBRARY_IMPL(ember, CompositeExplicitAutograd, m) { m.impl("embedding_grad", &embedding_grad); }

}  // namespace ember
