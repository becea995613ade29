// SizeBuckets: a call's symbolic sizes padded up to buckets, outputs sliced back (size_buckets.h says what it
// guarantees). Per call: no hashing, no strings; the tensors are made only where a size is not at its bucket.
#include "backend/runtime/size_buckets.h"

#include "ember/error.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/SmallVector.h>

#include <algorithm>

namespace ember {
namespace {

bool by_index(const SizeBuckets::Use& a, const SizeBuckets::Use& b) {
  return a.index != b.index ? a.index < b.index : a.dim < b.dim;
}

// Padding makes tensors and views of its own, recorded by no autograd (inference graphs only, buckets.py).
using BelowAutograd = c10::impl::ExcludeDispatchKeyGuard;

}  // namespace

SizeBuckets::SizeBuckets(std::vector<int64_t> sizes, std::vector<Symbol> symbols, std::vector<Use> inputs,
                         std::vector<Use> outputs, size_t num_inputs, size_t num_outputs)
    : sizes_(std::move(sizes)), symbols_(std::move(symbols)), inputs_(std::move(inputs)), outputs_(std::move(outputs)) {
  for (size_t i = 0; i < sizes_.size(); ++i)
    if (sizes_[i] < 1 || (i && sizes_[i] <= sizes_[i - 1]))
      throw Error("size buckets must be ascending integers >= 1");
  if (symbols_.empty()) throw Error("size buckets: no symbol to pad");
  for (const Symbol& s : symbols_)
    if (s.input >= num_inputs || s.dim < -1) throw Error("size buckets: symbol " + s.name + " read from no input");
  auto check = [&](const std::vector<Use>& uses, size_t count, const char* what) {
    for (const Use& u : uses)
      if (u.index >= count || u.dim < -1 || u.symbol >= symbols_.size())
        throw Error(std::string("size buckets: a padded ") + what + " out of range");
  };
  check(inputs_, num_inputs, "input");
  check(outputs_, num_outputs, "output");
  std::sort(inputs_.begin(), inputs_.end(), by_index);
  std::sort(outputs_.begin(), outputs_.end(), by_index);
  const size_t n = symbols_.size() * slots();
  calls_ = std::make_unique<std::atomic<uint64_t>[]>(n);
  for (size_t i = 0; i < n; ++i) calls_[i].store(0, std::memory_order_relaxed);
}

int64_t SizeBuckets::bucket(int64_t n) const {
  if (n < 1) return n;  // an empty call stays empty
  if (sizes_.empty()) {
    if (n > (int64_t{1} << 62)) return n;
    int64_t b = 1;
    while (b < n) b <<= 1;
    return b;
  }
  for (int64_t b : sizes_)
    if (b >= n) return b;
  return n;
}

size_t SizeBuckets::slot(int64_t n) const {
  const int64_t b = bucket(n);
  if (sizes_.empty()) {
    size_t k = 0;
    while (k < 63 && (int64_t{1} << k) < b) ++k;
    return k;
  }
  return static_cast<size_t>(std::lower_bound(sizes_.begin(), sizes_.end(), b) - sizes_.begin());
}

std::optional<SizeBuckets::Padded> SizeBuckets::pad(const std::vector<c10::IValue>& inputs) const {
  c10::SmallVector<int64_t, 4> real, target;
  bool grow = false;
  for (size_t s = 0; s < symbols_.size(); ++s) {
    const Symbol& sym = symbols_[s];
    const c10::IValue& v = inputs[sym.input];
    int64_t n = 0;
    if (sym.dim < 0 && v.isInt()) n = v.toInt();
    else if (sym.dim >= 0 && v.isTensor() && sym.dim < v.toTensor().dim()) n = v.toTensor().size(sym.dim);
    else throw Error("size buckets: input " + std::to_string(sym.input) + " does not hold the size " + sym.name);
    real.push_back(n);
    target.push_back(bucket(n));
    grow |= target.back() != n;
    if (n >= 1) calls_[s * slots() + slot(n)].fetch_add(1, std::memory_order_relaxed);
  }
  if (!grow) return std::nullopt;

  BelowAutograd below_autograd(c10::autograd_dispatch_keyset_with_ADInplaceOrView);
  Padded out{inputs, std::vector<int64_t>(real.begin(), real.end())};
  for (size_t u = 0; u < inputs_.size();) {
    const uint32_t index = inputs_[u].index;
    size_t end = u;
    while (end < inputs_.size() && inputs_[end].index == index) ++end;
    c10::IValue& v = out.inputs[index];
    if (inputs_[u].dim < 0) {  // an int input that is the size itself
      v = c10::IValue(target[inputs_[u].symbol]);
      u = end;
      continue;
    }
    if (!v.isTensor()) throw Error("size buckets: input " + std::to_string(index) + " is no tensor");
    const at::Tensor& t = v.toTensor();
    c10::SmallVector<int64_t, 6> sizes(t.sizes().begin(), t.sizes().end());
    bool padded = false;
    for (size_t k = u; k < end; ++k) {
      const Use& use = inputs_[k];
      if (use.dim >= t.dim() || sizes[use.dim] != real[use.symbol])
        throw Error("size buckets: input " + std::to_string(index) + " dim " + std::to_string(use.dim) +
                    " is not the size " + symbols_[use.symbol].name + " read from another input");
      padded |= target[use.symbol] != real[use.symbol];
      sizes[use.dim] = target[use.symbol];
    }
    if (padded) {
      // Zeros past the real rows of each padded dim, the caller's values in the real region; in the input's
      // memory format, as the graph was traced with its layout.
      at::Tensor grown = at::empty(sizes, t.options(), t.suggest_memory_format());
      at::Tensor region = grown;
      for (size_t k = u; k < end; ++k) {
        const Use& use = inputs_[k];
        const int64_t r = real[use.symbol], b = target[use.symbol];
        if (b != r) grown.narrow(use.dim, r, b - r).zero_();
        region = region.narrow(use.dim, 0, r);
      }
      region.copy_(t);
      v = std::move(grown);
    }
    u = end;
  }
  return out;
}

void SizeBuckets::slice(std::vector<c10::IValue>& outputs, const std::vector<int64_t>& real) const {
  BelowAutograd below_autograd(c10::autograd_dispatch_keyset_with_ADInplaceOrView);
  for (size_t u = 0; u < outputs_.size();) {
    const uint32_t index = outputs_[u].index;
    size_t end = u;
    while (end < outputs_.size() && outputs_[end].index == index) ++end;
    c10::IValue& v = outputs[index];
    if (outputs_[u].dim < 0) {  // an int output that is the size itself
      v = c10::IValue(real[outputs_[u].symbol]);
      u = end;
      continue;
    }
    if (!v.isTensor()) throw Error("size buckets: output " + std::to_string(index) + " is no tensor");
    at::Tensor t = v.toTensor();
    const c10::MemoryFormat format = t.suggest_memory_format();
    const bool dense = t.is_contiguous(format);
    bool narrowed = false;
    for (size_t k = u; k < end; ++k) {
      const Use& use = outputs_[k];
      const int64_t r = real[use.symbol];
      if (use.dim >= t.dim() || t.size(use.dim) < r)
        throw Error("size buckets: output " + std::to_string(index) + " is smaller than the call's size " +
                    symbols_[use.symbol].name);
      if (t.size(use.dim) != r) {
        t = t.narrow(use.dim, 0, r);
        narrowed = true;
      }
    }
    // Narrowing the leading dim keeps a dense output dense; an inner dim would leave a strided one, which eager
    // never returns (a later .view() would fail on it): copied then.
    if (narrowed) v = dense && !t.is_contiguous(format) ? t.contiguous(format) : t;
    u = end;
  }
}

std::vector<std::vector<std::pair<int64_t, uint64_t>>> SizeBuckets::calls() const {
  std::vector<std::vector<std::pair<int64_t, uint64_t>>> out(symbols_.size());
  for (size_t s = 0; s < symbols_.size(); ++s)
    for (size_t k = 0; k < slots(); ++k) {
      const uint64_t c = calls_[s * slots() + k].load(std::memory_order_relaxed);
      if (!c) continue;
      const int64_t size = sizes_.empty() ? (int64_t{1} << k) : k < sizes_.size() ? sizes_[k] : -1;
      out[s].emplace_back(size, c);
    }
  return out;
}

std::vector<std::string> SizeBuckets::describe() const {
  auto uses = [](const std::vector<Use>& all, uint32_t s, const char* what) {
    std::string text;
    for (const Use& u : all)
      if (u.symbol == s)
        text += (text.empty() ? std::string(what) + " " : ", ") + std::to_string(u.index) +
                (u.dim < 0 ? " (the size)" : " dim " + std::to_string(u.dim));
    return text.empty() ? std::string("no ") + what : text;
  };
  std::string buckets = "powers of two";
  if (!sizes_.empty()) {
    buckets.clear();
    for (int64_t b : sizes_) buckets += (buckets.empty() ? "" : ", ") + std::to_string(b);
  }
  const auto counts = calls();
  std::vector<std::string> out;
  for (uint32_t s = 0; s < symbols_.size(); ++s) {
    std::string ran;
    for (const auto& [size, n] : counts[s])
      ran += (ran.empty() ? "" : ", ") + (size < 0 ? std::string("above the largest") : std::to_string(size)) + " x" +
             std::to_string(n);
    out.push_back(symbols_[s].name + " to buckets " + buckets + ": pads " + uses(inputs_, s, "inputs") + "; slices " +
                  uses(outputs_, s, "outputs") + "; calls per size: " + (ran.empty() ? "none yet" : ran));
  }
  return out;
}

}  // namespace ember
