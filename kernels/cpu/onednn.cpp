// oneDNN matmul and 2-D convolution with fused post-ops: the only file that includes the system's dnnl.hpp
// (see onednn.h for why it is built apart from torch's headers).
//  1. One primitive per distinct call shape (M, N, K and the stride pattern), created on first use and kept:
//     the per-call cost is a lock, a short linear search, pointer updates and execute().
//  2. Weights in inference graphs are reordered once into the layout the primitive prefers (format "any"):
//     the brgemm kernels otherwise copy a plain weight matrix into blocks on every call.
//  3. Post-ops run in the primitive on each output tile while it is in cache: no separate pass over dst.
#include "kernels/cpu/onednn.h"

#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

namespace ember::onednn {
namespace {

using dnnl::memory;
void* const kNoHandle = nullptr;  // memory objects get their data pointer per call

const dnnl::engine& cpu_engine() {
  static const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

memory::data_type data_type(DType t) { return t == DType::BF16 ? memory::data_type::bf16 : memory::data_type::f32; }

dnnl::algorithm eltwise_algorithm(PostOp::Kind k) {
  switch (k) {
    case PostOp::Kind::Relu: return dnnl::algorithm::eltwise_relu;
    case PostOp::Kind::GeluErf: return dnnl::algorithm::eltwise_gelu_erf;
    case PostOp::Kind::GeluTanh: return dnnl::algorithm::eltwise_gelu_tanh;
    case PostOp::Kind::Silu: return dnnl::algorithm::eltwise_swish;
    case PostOp::Kind::Sigmoid: return dnnl::algorithm::eltwise_logistic;
    case PostOp::Kind::Tanh: return dnnl::algorithm::eltwise_tanh;
    case PostOp::Kind::Hardswish: return dnnl::algorithm::eltwise_hardswish;  // (oneDNN 2.x: alpha, beta ignored)
    case PostOp::Kind::Clamp: return dnnl::algorithm::eltwise_clip;
    case PostOp::Kind::Linear: return dnnl::algorithm::eltwise_linear;
    case PostOp::Kind::Add: break;
  }
  throw std::logic_error("not an eltwise post-op");
}

// The post-op chain; addend(i) is the memory layout of the i-th Add's tensor.
template <class AddendDesc>
dnnl::post_ops make_post_ops(const std::vector<PostOp>& post_ops, AddendDesc addend) {
  dnnl::post_ops ops;
  size_t a = 0;
  for (const PostOp& p : post_ops) {
    if (p.kind == PostOp::Kind::Add) {
      ops.append_binary(dnnl::algorithm::binary_add, addend(a++, p.row));
      continue;
    }
    // alpha is relu's negative slope (0), swish's beta (1), linear's scale, clip's lower bound; beta is
    // linear's shift, clip's upper bound.
    const bool own = p.kind == PostOp::Kind::Linear || p.kind == PostOp::Kind::Clamp;
    float alpha = own ? p.alpha : p.kind == PostOp::Kind::Silu ? 1.f : 0.f;
    float beta = own ? p.beta : 0.f;
    ops.append_eltwise(1.f, eltwise_algorithm(p.kind), alpha, beta);
  }
  return ops;
}

// The execute() arguments of the post-ops' tensors.
template <class Args>
void add_post_op_args(const std::vector<PostOp>& post_ops, const std::vector<memory>& addends, Args& args) {
  for (size_t i = 0, a = 0; i < post_ops.size(); ++i)
    if (post_ops[i].kind == PostOp::Kind::Add)
      args.emplace(DNNL_ARG_ATTR_MULTIPLE_POST_OP(static_cast<int>(i)) | DNNL_ARG_SRC_1, addends[a++]);
}

// What selects a primitive: everything about a call except its pointers.
struct ShapeKey {
  int64_t M, N, K, src_stride[2], weights_stride[2], dst_stride;
  std::vector<int64_t> addend_row_stride;

  static ShapeKey of(const MatmulCall& c) {
    return {c.M, c.N, c.K, {c.src_stride[0], c.src_stride[1]}, {c.weights_stride[0], c.weights_stride[1]},
            c.dst_stride, c.addend_row_stride};
  }
  bool operator==(const ShapeKey& o) const {
    return M == o.M && N == o.N && K == o.K && src_stride[0] == o.src_stride[0] &&
           src_stride[1] == o.src_stride[1] && weights_stride[0] == o.weights_stride[0] &&
           weights_stride[1] == o.weights_stride[1] && dst_stride == o.dst_stride &&
           addend_row_stride == o.addend_row_stride;
  }
};

// Weights packed into one layout: one copy per weights generation and layout in the process, shared by every
// shape whose primitive prefers that layout (batch sizes mostly do) and by every kernel reading those weights
// (ALBERT's layers run one weight four times; a recompile for new sizes reads the same parameters). Each kernel
// kept its own copy before: ALBERT-xxlarge's training forward held 3 GB of them, for 0.77 GB of weights.
struct PackedWeights {
  memory mem;
  uint64_t generation = 0;  // what mem holds; never changes once made
};

// The copy of `plain` (weights of `generation`) in `layout`, made here (a reorder on `stream`, under the lock,
// so no one reads it half made) where no live copy has them. *made: whether this call made it.
std::shared_ptr<const PackedWeights> packed_copy(uint64_t generation, const memory& plain, const memory::desc& layout,
                                                 dnnl::stream& stream, bool* made) {
  struct Known {
    uint64_t generation;
    memory::desc layout;
    std::weak_ptr<const PackedWeights> copy;
  };
  static std::mutex mu;
  static auto* known = new std::vector<Known>();  // never freed: outlives every kernel
  std::lock_guard<std::mutex> lock(mu);
  known->erase(std::remove_if(known->begin(), known->end(), [](const Known& k) { return k.copy.expired(); }),
               known->end());
  for (const Known& k : *known)
    if (k.generation == generation && k.layout == layout)
      if (auto copy = k.copy.lock()) {
        *made = false;
        return copy;
      }
  auto copy = std::make_shared<PackedWeights>();
  copy->mem = memory(layout, cpu_engine());  // owned by oneDNN
  memory src = plain;  // (a handle: execute() takes it non-const)
  dnnl::reorder(src, copy->mem).execute(stream, src, copy->mem);
  stream.wait();
  copy->generation = generation;
  known->push_back({generation, layout, copy});
  *made = true;
  return copy;
}

// The primitives for one shape: reading plain (strided) weights, and, once asked for, packed weights.
struct Entry {
  ShapeKey key;
  dnnl::matmul plain;
  memory src, weights, bias, dst;
  std::vector<memory> addends;
  // Packed weights: the primitive created on the first call with a nonzero generation; the copy it reads.
  dnnl::matmul packed;
  memory::desc packed_layout;
  std::shared_ptr<const PackedWeights> packed_weights;
  bool packed_is_plain = false;  // the preferred layout is the plain one: nothing to reorder
};

class MatmulImpl final : public Matmul {
 public:
  explicit MatmulImpl(MatmulConfig config) : config_(std::move(config)) {}

  void run(const MatmulCall& call, uint64_t generation) override {
    std::lock_guard<std::mutex> lock(mu_);
    try {
      run_locked(call, generation);
    } catch (const dnnl::error& e) {
      throw std::runtime_error(std::string("oneDNN: ") + e.what());
    }
  }

  void run_locked(const MatmulCall& call, uint64_t generation) {
    if (!stream_) stream_ = dnnl::stream(cpu_engine());  // made on first use: nothing of oneDNN's at compile time
    Entry& e = entry(call);
    void* weights = const_cast<void*>(call.weights);
    e.src.set_data_handle(const_cast<void*>(call.src));
    e.dst.set_data_handle(call.dst);
    if (config_.bias) e.bias.set_data_handle(const_cast<void*>(call.bias));
    for (size_t i = 0; i < e.addends.size(); ++i) e.addends[i].set_data_handle(const_cast<void*>(call.addends[i]));
    e.weights.set_data_handle(weights);

    const dnnl::matmul* prim = &e.plain;
    const memory* w = &e.weights;
    if (generation != 0) {
      if (!e.packed) make_packed(e);
      if (e.packed_is_plain) {
        // plain already is the preferred layout
      } else {
        if (!e.packed_weights || e.packed_weights->generation != generation) {
          bool made = false;
          e.packed_weights = packed_copy(generation, e.weights, e.packed_layout, stream_, &made);
          packings_ += made;
          // This Matmul's other shapes of the layout take it too: none keeps a stale copy alive.
          for (auto& other : entries_)
            if (other->packed_weights && other->packed_layout == e.packed_layout) other->packed_weights = e.packed_weights;
        }
        prim = &e.packed;
        w = &e.packed_weights->mem;
      }
    }
    std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, e.src}, {DNNL_ARG_WEIGHTS, *w}, {DNNL_ARG_DST, e.dst}};
    if (config_.bias) args.emplace(DNNL_ARG_BIAS, e.bias);
    add_post_op_args(config_.post_ops, e.addends, args);
    prim->execute(stream_, args);
    stream_.wait();
  }

  size_t primitives() const override { return entries_.size(); }
  size_t packings() const override { return packings_; }

 private:
  memory::desc matrix(int64_t rows, int64_t cols, int64_t s0, int64_t s1) const {
    return memory::desc({rows, cols}, data_type(config_.dtype), memory::dims{s0, s1});
  }

  dnnl::matmul::primitive_desc descriptor(const MatmulCall& c, bool any_weights) const {
    memory::desc src = matrix(c.M, c.K, c.src_stride[0], c.src_stride[1]);
    memory::desc weights = any_weights
        ? memory::desc({c.K, c.N}, data_type(config_.dtype), memory::format_tag::any)
        : matrix(c.K, c.N, c.weights_stride[0], c.weights_stride[1]);
    memory::desc dst = matrix(c.M, c.N, c.dst_stride, 1);
    size_t full = 0;  // the [M, N] addends' row strides, in order
    dnnl::post_ops ops = make_post_ops(config_.post_ops, [&](size_t, bool row) {
      return row ? matrix(1, c.N, c.N, 1) : matrix(c.M, c.N, c.addend_row_stride.at(full++), 1);
    });
    dnnl::primitive_attr attr;
    attr.set_post_ops(ops);
    if (config_.bias) {
      memory::desc bias = matrix(1, c.N, c.N, 1);
      return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, weights, bias, dst), attr, cpu_engine());
    }
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, weights, dst), attr, cpu_engine());
  }

  Entry& entry(const MatmulCall& call) {
    ShapeKey key = ShapeKey::of(call);
    for (auto& e : entries_)
      if (e->key == key) return *e;
    if (entries_.size() >= kMaxEntries) entries_.erase(entries_.begin());  // a stream of new shapes: keep the last ones
    auto e = std::make_unique<Entry>();
    e->key = key;
    auto pd = descriptor(call, false);
    e->plain = dnnl::matmul(pd);
    const dnnl::engine& eng = cpu_engine();
    e->src = memory(pd.src_desc(), eng, kNoHandle);
    e->weights = memory(pd.weights_desc(), eng, kNoHandle);
    e->dst = memory(pd.dst_desc(), eng, kNoHandle);
    if (config_.bias) e->bias = memory(matrix(1, call.N, call.N, 1), eng, kNoHandle);
    size_t full = 0;  // the [M, N] addends' row strides, in order (as in descriptor())
    for (const PostOp& p : config_.post_ops) {
      if (p.kind != PostOp::Kind::Add) continue;
      memory::desc md = p.row ? matrix(1, call.N, call.N, 1) : matrix(call.M, call.N, call.addend_row_stride.at(full++), 1);
      e->addends.emplace_back(md, eng, kNoHandle);
    }
    entries_.push_back(std::move(e));
    return *entries_.back();
  }

  void make_packed(Entry& e) {
    auto pd = descriptor(call_shape_of(e), true);
    e.packed = dnnl::matmul(pd);
    e.packed_layout = pd.weights_desc();
    e.packed_is_plain = e.packed_layout == e.weights.get_desc();
  }

  static MatmulCall call_shape_of(const Entry& e) {
    MatmulCall c;
    c.M = e.key.M, c.N = e.key.N, c.K = e.key.K;
    c.src_stride[0] = e.key.src_stride[0], c.src_stride[1] = e.key.src_stride[1];
    c.weights_stride[0] = e.key.weights_stride[0], c.weights_stride[1] = e.key.weights_stride[1];
    c.dst_stride = e.key.dst_stride;
    c.addend_row_stride = e.key.addend_row_stride;
    return c;
  }

  static constexpr size_t kMaxEntries = 16;
  MatmulConfig config_;
  dnnl::stream stream_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Entry>> entries_;
  size_t packings_ = 0;  // packed copies this Matmul made (others' copies it reads are not counted)
};

// A 2-D convolution's primitives for one shape and layout, as Entry is for a matmul.
struct ConvEntry {
  std::vector<int64_t> key;
  dnnl::convolution_forward plain, packed;
  memory src, weights, bias, dst, packed_weights;
  std::vector<memory> addends;
  uint64_t packed_generation = 0;
  bool packed_is_plain = false;
};

memory::dims dims_of(const int64_t* v, int n) { return memory::dims(v, v + n); }

class Conv2dImpl final : public Conv2d {
 public:
  explicit Conv2dImpl(Conv2dConfig config) : config_(std::move(config)) {}

  void run(const Conv2dCall& call, uint64_t generation) override {
    std::lock_guard<std::mutex> lock(mu_);
    try {
      if (!stream_) stream_ = dnnl::stream(cpu_engine());
      ConvEntry& e = entry(call);
      e.src.set_data_handle(const_cast<void*>(call.src));
      e.weights.set_data_handle(const_cast<void*>(call.weights));
      e.dst.set_data_handle(call.dst);
      if (config_.bias) e.bias.set_data_handle(const_cast<void*>(call.bias));
      for (size_t i = 0; i < e.addends.size(); ++i) e.addends[i].set_data_handle(const_cast<void*>(call.addends[i]));
      const dnnl::convolution_forward* prim = &e.plain;
      const memory* w = &e.weights;
      if (generation != 0) {
        if (!e.packed) {
          auto pd = descriptor(call, true);
          e.packed = dnnl::convolution_forward(pd);
          e.packed_is_plain = pd.weights_desc() == e.weights.get_desc();
          if (!e.packed_is_plain) e.packed_weights = memory(pd.weights_desc(), cpu_engine());
        }
        if (!e.packed_is_plain) {
          if (e.packed_generation != generation) {
            dnnl::reorder(e.weights, e.packed_weights).execute(stream_, e.weights, e.packed_weights);
            e.packed_generation = generation;
          }
          prim = &e.packed;
          w = &e.packed_weights;
        }
      }
      std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, e.src}, {DNNL_ARG_WEIGHTS, *w}, {DNNL_ARG_DST, e.dst}};
      if (config_.bias) args.emplace(DNNL_ARG_BIAS, e.bias);
      add_post_op_args(config_.post_ops, e.addends, args);
      prim->execute(stream_, args);
      stream_.wait();
    } catch (const dnnl::error& err) {
      throw std::runtime_error(std::string("oneDNN: ") + err.what());
    }
  }

 private:
  memory::desc tensor(const int64_t* sizes, const int64_t* strides) const {
    return memory::desc(dims_of(sizes, 4), data_type(config_.dtype), dims_of(strides, 4));
  }

  // Grouped weights are 5-D for oneDNN: [G, OC / G, IC / G, KH, KW].
  memory::desc weights_desc(const Conv2dCall& c, bool any) const {
    const int64_t* s = c.weights_sizes;
    const int64_t* st = c.weights_strides;
    auto dt = data_type(config_.dtype);
    int64_t g = config_.groups;
    if (g == 1) return any ? memory::desc(dims_of(s, 4), dt, memory::format_tag::any) : tensor(s, st);
    memory::dims d = {g, s[0] / g, s[1], s[2], s[3]};
    if (any) return memory::desc(d, dt, memory::format_tag::any);
    return memory::desc(d, dt, memory::dims{st[0] * (s[0] / g), st[0], st[1], st[2], st[3]});
  }

  dnnl::convolution_forward::primitive_desc descriptor(const Conv2dCall& c, bool any_weights) const {
    memory::desc src = tensor(c.src_sizes, c.src_strides);
    memory::desc dst = tensor(c.dst_sizes, c.dst_strides);
    memory::desc weights = weights_desc(c, any_weights);
    memory::dims strides = dims_of(config_.stride, 2), pad_l = dims_of(config_.padding, 2), dil(2), pad_r(2);
    for (int i = 0; i < 2; ++i) {
      dil[i] = config_.dilation[i] - 1;  // oneDNN counts the gaps
      int64_t extent = (c.weights_sizes[2 + i] - 1) * config_.dilation[i] + 1;
      pad_r[i] = (c.dst_sizes[2 + i] - 1) * config_.stride[i] + extent - c.src_sizes[2 + i] - config_.padding[i];
    }
    dnnl::post_ops ops = make_post_ops(config_.post_ops, [&](size_t, bool) { return dst; });
    dnnl::primitive_attr attr;
    attr.set_post_ops(ops);
    auto prop = dnnl::prop_kind::forward_inference;
    auto alg = dnnl::algorithm::convolution_direct;
    if (config_.bias) {
      memory::desc bias({c.weights_sizes[0]}, data_type(config_.dtype), memory::format_tag::a);
      return {dnnl::convolution_forward::desc(prop, alg, src, weights, bias, dst, strides, dil, pad_l, pad_r), attr,
              cpu_engine()};
    }
    return {dnnl::convolution_forward::desc(prop, alg, src, weights, dst, strides, dil, pad_l, pad_r), attr, cpu_engine()};
  }

  ConvEntry& entry(const Conv2dCall& c) {
    std::vector<int64_t> key;
    for (const int64_t* v : {c.src_sizes, c.src_strides, c.weights_sizes, c.weights_strides, c.dst_sizes, c.dst_strides})
      key.insert(key.end(), v, v + 4);
    for (auto& e : entries_)
      if (e->key == key) return *e;
    if (entries_.size() >= 16) entries_.erase(entries_.begin());
    auto e = std::make_unique<ConvEntry>();
    e->key = std::move(key);
    auto pd = descriptor(c, false);
    e->plain = dnnl::convolution_forward(pd);
    const dnnl::engine& eng = cpu_engine();
    e->src = memory(pd.src_desc(), eng, kNoHandle);
    e->weights = memory(pd.weights_desc(), eng, kNoHandle);
    e->dst = memory(pd.dst_desc(), eng, kNoHandle);
    if (config_.bias) e->bias = memory(pd.bias_desc(), eng, kNoHandle);
    for (const PostOp& p : config_.post_ops)
      if (p.kind == PostOp::Kind::Add) e->addends.emplace_back(pd.dst_desc(), eng, kNoHandle);
    entries_.push_back(std::move(e));
    return *entries_.back();
  }

  Conv2dConfig config_;
  dnnl::stream stream_;
  std::mutex mu_;
  std::vector<std::unique_ptr<ConvEntry>> entries_;
};

}  // namespace

bool available() { return true; }

std::string version() {
  const dnnl_version_t* v = dnnl_version();
  return "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
}

std::unique_ptr<Matmul> Matmul::create(const MatmulConfig& config, std::string* why_not) {
  (void)why_not;  // primitives are made per shape on first use; a shape oneDNN rejects runs through ATen
  return std::make_unique<MatmulImpl>(config);
}

std::unique_ptr<Conv2d> Conv2d::create(const Conv2dConfig& config, std::string* why_not) {
  for (const PostOp& p : config.post_ops)
    if (p.kind == PostOp::Kind::Add && p.row) {
      if (why_not) *why_not = "a broadcast addend after a convolution";
      return nullptr;
    }
  return std::make_unique<Conv2dImpl>(config);
}

}  // namespace ember::onednn
