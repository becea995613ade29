// The host side of one fused-kernel call (call_plan.h): Params, outputs, entry point and grid.
#include "kernels/cuda/call_plan.h"

#include "ember/error.h"
#include "kernels/iteration_space.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

namespace ember::cuda {
namespace {

constexpr unsigned kThreads = 256;

bool aligned(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// Enough blocks for `work_items` at `per_block` each: at most one wave of `entry` where `capped`, else
// every block the work fills (the grid-stride loops then run once), within a grid's x limit.
unsigned blocks_for(int64_t work_items, int64_t per_block, const LaunchLimits& limits, size_t entry, unsigned threads,
                    bool capped = true) {
  const int64_t most = capped ? limits.wave(entry, threads) : int64_t{0x7fffffff};
  return static_cast<unsigned>(std::clamp<int64_t>((work_items + per_block - 1) / per_block, 1, most));
}

// Every aligned stride 0 (or its dimension of size 1): one value for all elements.
bool one_value(const int64_t* stride, const std::vector<int64_t>& full) {
  for (size_t d = 0; d < full.size(); ++d)
    if (stride[d] != 0 && full[d] != 1) return false;
  return true;
}

// Contiguous over the trailing dimensions and broadcast (stride 0) over the leading ones: the number
// of elements after which the input repeats; 0 where it does not have that form.
int64_t repeat_period(const int64_t* stride, const std::vector<int64_t>& full) {
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

// Broadcast over the trailing dimensions (stride 0, `span` elements in all) and over the leading ones,
// contiguous over the dimensions between (`count` values: NCHW's per-channel [C, 1, 1]): element i
// reads value (i / span) % count. False where the input does not have that form, or span is 1 (then
// repeat_period's form).
bool channel_form(const int64_t* stride, const std::vector<int64_t>& full, int64_t* span, int64_t* count) {
  *span = 1;
  *count = 1;
  size_t d = full.size();
  for (; d-- > 0;) {
    if (full[d] == 1) continue;
    if (stride[d] != 0) break;
    *span *= full[d];
  }
  if (d == static_cast<size_t>(-1) || *span == 1) return false;
  for (d = d + 1; d-- > 0;) {
    if (full[d] == 1) continue;
    if (stride[d] != *count) break;
    *count *= full[d];
  }
  for (d = d + 1; d-- > 0;)
    if (full[d] != 1 && stride[d] != 0) return false;
  return *count > 1;
}

// Contiguous in the iteration space (row-major over the full shape; size-1 dims take any stride).
bool contiguous(const int64_t* stride, const std::vector<int64_t>& full) {
  int64_t expected = 1;
  for (size_t d = full.size(); d-- > 0;) {
    if (full[d] == 1) continue;
    if (stride[d] != expected) return false;
    expected *= full[d];
  }
  return true;
}

// Row groups: every row's columns contiguous and every row start aligned to the vector width.
bool row_vectorizable(const int64_t* stride, const std::vector<int64_t>& full, int64_t cols, int width) {
  if (full.empty() || cols % width != 0 || (cols > 1 && stride[full.size() - 1] != 1)) return false;
  for (size_t d = 0; d + 1 < full.size(); ++d)
    if (stride[d] % width != 0) return false;
  return true;
}

// Flat groups: the vector kernel where outputs are aligned (below one vector it would run only its
// tail), its strided entry where some input is neither vector-loaded nor one value.
void plan_flat(CallPlan& plan, int64_t numel, const uint32_t masks[4], size_t inputs, int width, int unroll,
               const LaunchLimits& limits) {
  const bool vector = (masks[0] & kVectorOutputs) && numel >= width;
  bool strided = inputs > static_cast<size_t>(kMaxVectorInputs);
  for (size_t k = 0; k < inputs && k < static_cast<size_t>(kMaxVectorInputs); ++k)
    strided |= !(((masks[0] | masks[1] | masks[2] | masks[3]) >> k) & 1u);
  plan.entry = vector ? (strided ? 2 : 1) : 0;
  plan.threads = kThreads;
  // Every block the work fills, not one wave (call_plan.h)
  plan.blocks = vector ? blocks_for(numel / width, int64_t{kThreads} * unroll, limits, plan.entry, kThreads, false)
                       : blocks_for(numel, kThreads, limits, plan.entry, kThreads, false);
}

// `rows` in `splits` chunks of ceil(rows / splits) rows, as many as the rows fill: none is empty.
unsigned whole_chunks(int64_t rows, int64_t splits) {
  if (rows <= 0 || splits <= 1) return 1;
  const int64_t chunk = (rows + splits - 1) / splits;
  return static_cast<unsigned>((rows + chunk - 1) / chunk);
}

// Column groups: a block per tile of 32 columns and chunk of rows (the kernel's shape, cuda_source.cpp:
// columns()). The rows split only where the tiles fill less than half a wave, into as many chunks as
// bring the grid to one wave, each at least kColumnChunkRows long.
void plan_columns(CallPlan& plan, int64_t columns, int64_t rows, const LaunchLimits& limits) {
  plan.entry = 0;
  plan.threads = kColumnThreads;
  plan.blocks = blocks_for(columns, 32, limits, 0, kColumnThreads);
  const int64_t tiles = (columns + 31) / 32, wave = limits.wave(0, kColumnThreads);
  if (tiles * 2 > wave) return;
  const int64_t most = std::max<int64_t>(1, rows / kColumnChunkRows);
  int64_t splits = std::clamp<int64_t>(wave / std::max<int64_t>(tiles, 1), 1, std::min<int64_t>(most, 65535));
  if (splits <= 1) return;
  plan.splits = whole_chunks(rows, splits);
}

void plan_rows(CallPlan& plan, int64_t rows, int64_t cols, const CudaSource& source, const LaunchLimits& limits) {
  const int width = source.vector_width;
  auto index_of = [&](const RowVariant& v) {
    for (size_t i = 0; i < source.rows.size(); ++i)
      if (source.rows[i].entry == v.entry) return i;
    throw Error("CUDA fused kernel: row variant " + v.entry + " not compiled");
  };
  auto launchable = [&](const RowVariant& v) {
    const int64_t most = limits.most_threads(1 + index_of(v));
    return v.mode == RowVariant::Mode::Warp ? most >= 32 : block_threads(v, cols, width) <= most;
  };
  std::optional<RowVariant> v = choose_row_variant(cols, width, source.rows, launchable);
  if (!v) {
    plan.entry = 0;
    plan.threads = cols <= 64 ? 64 : (cols <= 512 ? 128 : 256);
    plan.blocks = blocks_for(rows, 1, limits, 0, plan.threads);
    return;
  }
  plan.entry = 1 + index_of(*v);
  if (v->mode == RowVariant::Mode::Warp) {
    plan.threads = static_cast<unsigned>(std::min<int64_t>(kThreads, limits.most_threads(plan.entry) / 32 * 32));
    plan.blocks = blocks_for(rows, plan.threads / 32, limits, plan.entry, plan.threads);
    return;
  }
  plan.threads = static_cast<unsigned>(std::max<int64_t>(block_threads(*v, cols, width), 32));
  plan.blocks = blocks_for(rows, 1, limits, plan.entry, plan.threads);
}

}  // namespace

void set_workspace(CallPlan& plan, float* part, unsigned* count) {
  std::memcpy(&plan.params[plan.workspace_word], &part, sizeof(part));
  std::memcpy(&plan.params[plan.workspace_word + 1], &count, sizeof(count));
}

int64_t LaunchLimits::wave(size_t entry, unsigned threads) const {
  const size_t size = (std::clamp<unsigned>(threads, 32, 1024) + 31) / 32 - 1;
  int per_multiprocessor = entry < resident.size() && size < resident[entry].size() ? resident[entry][size]
                                                                                     : static_cast<int>(2048 / std::max(threads, 32u));
  return std::max<int64_t>(1, multiprocessors * std::max(per_multiprocessor, 1));
}

CallPlan plan_call(const Program& program, const CudaSource& source, const std::vector<c10::ScalarType>& out_dtypes,
                   const std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads, c10::Device device,
                   const LaunchLimits& limits) {
  CallPlan plan;
  const size_t ni = program.inputs.size(), no = program.outputs.size(), rank = std::max<size_t>(program.rank, 1);
  const IterationSpace space = iteration_space(program, buffers, reads);
  // A pointwise group whose outputs are dense in another order than row-major (channels_last; passes/
  // fuse.cpp keeps one order per group) iterates in that order (source.iteration_order, made with the
  // source): its dimensions permuted, outermost in memory first, and its outputs laid out so, as eager
  // lays them out; inputs in the same layout then take the contiguous vector path. `perm[i]` is the
  // logical dimension iterated at position i.
  static const std::vector<int> row_major;
  const std::vector<int>& perm = source.iteration_order.size() == space.full.size() ? source.iteration_order : row_major;
  std::vector<int64_t> permuted_full;
  for (int d : perm) permuted_full.push_back(space.full[static_cast<size_t>(d)]);
  const std::vector<int64_t>& full = perm.empty() ? space.full : permuted_full;
  const int64_t numel = space.numel, rows = space.rows, cols = space.cols;
  const int width = source.vector_width;

  // Params, laid out as the printed struct.
  const size_t in_words = std::max<size_t>(ni, 1), out_words = std::max<size_t>(no, 1);
  std::vector<int64_t>& words = plan.params;
  words.assign(in_words + out_words + rank + in_words * rank + 5 + 2 * in_words +
                   (std::max<size_t>(program.scalars.size(), 1) + 1) / 2 + (program.outer > 0 ? 4 : 0),
               0);
  const size_t stride_base = in_words + out_words + rank;
  size_t w = 0;
  for (size_t k = 0; k < in_words; ++k, ++w)
    if (k < ni) {
      const void* ptr = buffers[reads[k]].toTensor().data_ptr();
      std::memcpy(&words[w], &ptr, sizeof(ptr));
    }
  std::vector<at::Tensor>& outs = plan.outputs;
  outs.reserve(no);
  bool outputs_aligned = true;
  for (size_t k = 0; k < out_words; ++k, ++w)
    if (k < no) {
      const at::TensorOptions options = at::TensorOptions().device(device).dtype(out_dtypes[k]);
      if (perm.empty()) {
        outs.push_back(at::empty(output_shape(program.outputs[k], space.full, program.has_reduction, program.outer), options));
      } else {
        std::vector<int64_t> strides(perm.size());
        int64_t step = 1;
        for (size_t i = perm.size(); i-- > 0;) {
          strides[static_cast<size_t>(perm[i])] = step;
          step *= space.full[static_cast<size_t>(perm[i])];
        }
        outs.push_back(at::empty_strided(space.full, strides, options));
      }
      void* ptr = outs.back().data_ptr();
      outputs_aligned &= aligned(ptr, width * c10::elementSize(out_dtypes[k]));
      std::memcpy(&words[w], &ptr, sizeof(ptr));
    }
  for (size_t d = 0; d < rank; ++d) words[w++] = d < full.size() ? full[d] : 1;
  for (size_t k = 0; k < in_words; ++k, w += rank) {
    if (k >= ni) continue;
    if (program.outer > 0) {
      // A column group's column input (aligned to the kept shape, by its trailing dims as the CPU aligns
      // it) has its strides at the kept dims' places, so the kernel indexes every input by full dimension.
      const at::Tensor& t = buffers[reads[k]].toTensor();
      if (program.inputs[k].row) aligned_strides(t, space.row_shape, &words[w + program.outer], true);
      else aligned_strides(t, full, &words[w], true);
      continue;
    }
    if (perm.empty()) {
      aligned_strides(buffers[reads[k]].toTensor(), program.inputs[k].row ? space.row_shape : full, &words[w]);
      continue;
    }
    int64_t logical[16];
    aligned_strides(buffers[reads[k]].toTensor(), space.full, logical);
    for (size_t i = 0; i < perm.size(); ++i) words[w + i] = logical[perm[i]];
  }
  words[w++] = numel;
  words[w++] = rows;
  words[w++] = cols;
  uint32_t masks[4] = {0, 0, 0, 0};  // vec, bcast, inner, chan
  int64_t* period = &words[w + 2];
  int64_t* span = period + in_words;
  // (Column kernels read element by element: their masks stay 0.)
  for (size_t k = 0; k < ni && k < static_cast<size_t>(kMaxVectorInputs) && program.outer == 0; ++k) {
    if (program.inputs[k].row) continue;
    const at::Tensor& t = buffers[reads[k]].toTensor();
    const int64_t* stride = &words[stride_base + k * rank];
    const bool vector_aligned = aligned(t.data_ptr(), width * t.element_size());
    if (vector_aligned && (program.has_reduction ? row_vectorizable(stride, full, cols, width) : contiguous(stride, full)))
      masks[0] |= 1u << k;
    else if (one_value(stride, full))
      masks[1] |= 1u << k;
    else if (((source.repeat_inputs >> k) & 1u) && vector_aligned && (period[k] = repeat_period(stride, full)) > 0 &&
             period[k] % width == 0 && period[k] < (int64_t{1} << 31))  // (the kernel's offsets are 32-bit)
      masks[2] |= 1u << k;
    else if (((source.channel_inputs >> k) & 1u) && channel_form(stride, full, &span[k], &period[k]))
      masks[3] |= 1u << k;
  }
  if (outputs_aligned && program.outer == 0 && (!program.has_reduction || cols % width == 0)) masks[0] |= kVectorOutputs;
  std::memcpy(&words[w], masks, sizeof(masks));
  std::memcpy(plan.masks, masks, sizeof(masks));
  plan.numel = numel;
  plan.rows = rows;
  plan.cols = cols;
  w += 2 + 2 * in_words;
  float* scalars = reinterpret_cast<float*>(&words[w]);
  for (size_t s = 0; s < program.scalars.size(); ++s) {
    const c10::IValue& v = buffers[reads[ni + s]];
    scalars[s] = v.isDouble() ? static_cast<float>(v.toDouble()) : v.isBool() ? float(v.toBool()) : float(v.toInt());
  }

  plan.launch = numel > 0 || (program.has_reduction && rows > 0);
  if (program.outer > 0) {  // part, count, splits, chunk: after the scalars, 8-byte aligned
    plan.workspace_word = w + (std::max<size_t>(program.scalars.size(), 1) + 1) / 2;
    int64_t* split_words = &words[plan.workspace_word];
    split_words[2] = 1;
    split_words[3] = cols;
    if (plan.launch) plan_columns(plan, rows, cols, limits);
    if (plan.splits > 1) {
      plan.workspace_floats = int64_t{source.column_reductions} * plan.splits * rows;
      plan.counters = (rows + 31) / 32;
      split_words[2] = plan.splits;
      split_words[3] = (cols + plan.splits - 1) / plan.splits;
    }
    return plan;
  }
  if (plan.launch) {
    if (program.has_reduction) plan_rows(plan, rows, cols, source, limits);
    else plan_flat(plan, numel, masks, ni, width, source.flat_unroll, limits);
  }
  return plan;
}

std::vector<LaunchChoice> launch_candidates(const CallPlan& plan, const Program& program, const CudaSource& source,
                                            const LaunchLimits& limits) {
  std::vector<LaunchChoice> out{launch_of(plan)};
  if (!plan.launch) return out;
  auto add = [&](const LaunchChoice& c) {
    if (std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
  };
  // `threads`-thread blocks of `entry` over `items` of work, `per_block` to a block: one wave, and every block.
  auto both_grids = [&](uint32_t entry, unsigned threads, int64_t items, int64_t per_block) {
    add({entry, threads, blocks_for(items, per_block, limits, entry, threads), 1});
    add({entry, threads, blocks_for(items, per_block, limits, entry, threads, false), 1});
  };
  auto known = [&](size_t entry) {
    return entry == plan.entry || (entry < limits.resident.size() && !limits.resident[entry].empty());
  };
  static constexpr unsigned kBlockSizes[] = {64, 128, 256, 512, 1024};

  if (program.outer > 0) {
    // (plan.rows counts the kept positions, the tiles' columns; plan.cols the rows each reduces.)
    const int64_t columns = plan.rows, rows = plan.cols, tiles = (columns + 31) / 32;
    const int64_t wave = limits.wave(0, kColumnThreads);
    const unsigned one_wave = blocks_for(columns, 32, limits, 0, kColumnThreads);
    // Chunks of at least half the rows plan_columns gives one, and only where every tile's chunks run at once.
    const int64_t most = tiles <= wave ? std::min<int64_t>(rows / (kColumnChunkRows / 2), 65535) : 1;
    for (int64_t splits : {int64_t{plan.splits} / 2, int64_t{plan.splits} * 2, int64_t{1}})
      if (splits >= 1 && (splits == 1 || splits <= most)) add({0, kColumnThreads, one_wave, whole_chunks(rows, splits)});
    add({0, kColumnThreads, blocks_for(columns, 32, limits, 0, kColumnThreads, false), 1});
    return out;
  }
  if (!program.has_reduction) {
    const bool vector = plan.entry != 0;
    const int64_t items = vector ? plan.numel / source.vector_width : plan.numel;
    const uint32_t entry = static_cast<uint32_t>(plan.entry);
    for (unsigned t : kBlockSizes)
      if (t <= limits.most_threads(entry)) both_grids(entry, t, items, int64_t{t} * (vector ? source.flat_unroll : 1));
    return out;
  }
  const int width = source.vector_width;
  const int64_t rows = plan.rows, cols = plan.cols;
  if (known(0))
    for (unsigned t : kBlockSizes)
      if (t <= limits.most_threads(0)) both_grids(0, t, rows, 1);
  for (size_t i = 0; i < source.rows.size(); ++i) {
    const RowVariant& v = source.rows[i];
    const uint32_t entry = static_cast<uint32_t>(1 + i);
    if (!known(entry)) continue;
    const int64_t most = limits.most_threads(entry);
    if (v.mode == RowVariant::Mode::Warp) {  // a row per warp: T / 32 rows per block
      if (cols > int64_t{v.chunks} * width * 32) continue;
      for (unsigned t : kBlockSizes)
        if (t <= most) both_grids(entry, t, rows, t / 32);
    } else {  // a row per block, of the threads the row needs (more would hold nothing)
      const int64_t need = block_threads(v, cols, width);
      if (cols > int64_t{v.chunks} * width * 1024 || need > most) continue;
      both_grids(entry, static_cast<unsigned>(std::max<int64_t>(need, 32)), rows, 1);
    }
  }
  return out;
}

void apply_launch(CallPlan& plan, const LaunchChoice& choice, const CudaSource& source) {
  plan.entry = choice.entry;
  plan.threads = choice.threads;
  plan.blocks = choice.blocks;
  if (choice.splits == plan.splits) return;
  // A column group's chunks (only they split): the Params' splits and chunk words and the workspace they need.
  plan.splits = choice.splits;
  int64_t* split_words = &plan.params[plan.workspace_word];
  split_words[2] = choice.splits;
  split_words[3] = (plan.cols + choice.splits - 1) / choice.splits;
  plan.workspace_floats = choice.splits > 1 ? int64_t{source.column_reductions} * choice.splits * plan.rows : 0;
  plan.counters = choice.splits > 1 ? (plan.rows + 31) / 32 : 0;
}

std::string launch_name(const LaunchChoice& choice, const Program& program, const CudaSource& source) {
  std::string entry = "general";
  if (program.outer > 0) entry = "cols";
  else if (!program.has_reduction && choice.entry > 0) entry = choice.entry == 1 ? "vec" : "vec_strided";
  else if (choice.entry > 0 && choice.entry <= source.rows.size()) {
    const std::string& name = source.rows[choice.entry - 1].entry;
    entry = name.substr(name.rfind('_') + 1);  // "ember_fused_w4": "w4"
  }
  std::string out = entry + " " + std::to_string(choice.threads) + "t " + std::to_string(choice.blocks) + "b";
  if (choice.splits > 1) out += " " + std::to_string(choice.splits) + "s";
  return out;
}

}  // namespace ember::cuda
