#include "kernels/iteration_space.h"

#include "ember/error.h"

namespace ember {

std::vector<int64_t> full_shape(const Program& p, const std::vector<c10::IValue>& buffers,
                                const std::vector<uint32_t>& reads) {
  std::vector<int64_t> shape;
  for (size_t i = 0; i < p.inputs.size(); ++i) {
    if (p.inputs[i].row) continue;
    at::IntArrayRef sizes = buffers[reads[i]].toTensor().sizes();
    if (sizes.size() > shape.size()) shape.insert(shape.begin(), sizes.size() - shape.size(), 1);
    size_t off = shape.size() - sizes.size();
    for (size_t d = 0; d < sizes.size(); ++d) {
      int64_t& s = shape[off + d];
      if (s == 1) s = sizes[d];
      else if (sizes[d] != 1 && sizes[d] != s) throw Error("fused kernel: inputs do not broadcast");
    }
  }
  if (shape.size() < p.rank) shape.insert(shape.begin(), p.rank - shape.size(), 1);
  return shape;
}

IterationSpace iteration_space(const Program& p, const std::vector<c10::IValue>& buffers,
                               const std::vector<uint32_t>& reads) {
  IterationSpace s;
  s.full = full_shape(p, buffers, reads);
  for (int64_t d : s.full) s.numel *= d;
  if (p.outer > 0) {
    s.row_shape.assign(s.full.begin() + static_cast<int64_t>(p.outer), s.full.end());
    for (int64_t d : s.row_shape) s.rows *= d;
    s.cols = 1;
    for (size_t d = 0; d < p.outer; ++d) s.cols *= s.full[d];
    return s;
  }
  s.cols = p.has_reduction ? s.full.back() : s.numel;
  s.row_shape.assign(s.full.begin(), s.full.end() - (p.has_reduction ? 1 : 0));
  for (int64_t d : s.row_shape) s.rows *= d;
  return s;
}

void aligned_strides(const at::Tensor& t, const std::vector<int64_t>& space, int64_t* out, bool trailing) {
  int64_t rank = std::min<int64_t>(t.dim(), static_cast<int64_t>(space.size()));
  int64_t off = static_cast<int64_t>(space.size()) - rank;
  int64_t skip = trailing ? t.dim() - rank : 0;  // leading dims of t beyond the space's rank
  for (int64_t d = 0; d < off; ++d) out[d] = 0;
  for (int64_t d = 0; d < rank; ++d)
    out[off + d] = t.size(skip + d) == 1 && space[off + d] != 1 ? 0 : t.stride(skip + d);
}

std::vector<int64_t> output_shape(const ProgramOutput& o, const std::vector<int64_t>& full, bool has_reduction,
                                  size_t outer) {
  if (!o.row) return full;
  if (outer > 0) {  // the kept dims, after `outer` ones if keepdim
    std::vector<int64_t> shape(o.keepdim ? outer : 0, 1);
    shape.insert(shape.end(), full.begin() + static_cast<int64_t>(outer), full.end());
    return shape;
  }
  std::vector<int64_t> shape(full.begin(), full.end() - (has_reduction ? 1 : 0));
  if (o.keepdim) shape.push_back(1);
  return shape;
}

}  // namespace ember
