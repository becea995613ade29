// Size buckets (the pad_to_buckets option): a graph over a symbolic size runs at that size rounded up to a
// bucket, so that the plan, and reduce-overhead's CUDA graphs (one set per input signature), meet few sizes.
//
// What it guarantees:
//  1. Everything is decided at compile time (python_bindings/ember/buckets.py reads the symbols and hands the
//     plan over): which inputs carry which symbol at which dim, which outputs do, where a call's real size is read.
//  2. Per call: each symbol's size read from one input, its bucket found (a short scan or a bit trick), and only
//     where some size is not at its bucket already: the tensors carrying it copied into zero-filled tensors of the
//     bucket's size, the int inputs holding it replaced, the plan run, and every output carrying it narrowed back
//     (a view; made contiguous where narrowing an inner dim broke contiguity) or, for an int, given the real size.
//  3. A size above the largest bucket runs as it is.
//  4. Calls per bucket are counted, for ember.explain.
// Correct only where rows along the padded dim are independent (buckets.py refuses what it can see is not).
#pragma once

#include <ATen/core/ivalue.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ember {

class SizeBuckets {
 public:
  // Where a call's real size of one symbol is read: input `input`'s dim `dim`, or the int input itself (dim -1).
  struct Symbol {
    std::string name;  // as the graph's types print it ("s0"), for describe()
    uint32_t input = 0;
    int32_t dim = -1;
  };
  // An input or output (`index`) carrying symbol `symbol`: as the size of its dim `dim`, or (dim -1) as the int
  // it is.
  struct Use {
    uint32_t index = 0;
    int32_t dim = -1;
    uint32_t symbol = 0;
  };
  // `sizes`: the buckets, ascending (empty: powers of two). Throws ember::Error where a symbol or use is out of
  // range of the graph's `num_inputs` / `num_outputs` (a damaged compile cache entry).
  SizeBuckets(std::vector<int64_t> sizes, std::vector<Symbol> symbols, std::vector<Use> inputs,
              std::vector<Use> outputs, size_t num_inputs, size_t num_outputs);

  // The size a real size `n` runs at: the smallest bucket >= n, or n above the largest.
  int64_t bucket(int64_t n) const;

  struct Padded {
    std::vector<c10::IValue> inputs;  // the call's inputs with each symbol at its bucket
    std::vector<int64_t> real;        // per symbol: the call's own size
  };
  // nullopt where every symbol is at its bucket already (the call runs on its inputs as they are). Throws
  // ember::Error where an input does not have the kind the plan expects there.
  std::optional<Padded> pad(const std::vector<c10::IValue>& inputs) const;
  // Outputs of the padded run, back to the call's sizes.
  void slice(std::vector<c10::IValue>& outputs, const std::vector<int64_t>& real) const;

  // Per symbol: its name, what carries it and how many calls ran at each size ("s0: ... sizes run: 8 x3, 16 x1").
  std::vector<std::string> describe() const;
  // Per symbol, (size run at, calls) for every size that ran (0 calls left out); a size above the largest bucket
  // reports as -1 (it ran at its own).
  std::vector<std::vector<std::pair<int64_t, uint64_t>>> calls() const;

 private:
  size_t slot(int64_t n) const;  // the counter of real size n: its bucket's position; the last one: above them
  size_t slots() const { return sizes_.empty() ? 64 : sizes_.size() + 1; }

  std::vector<int64_t> sizes_;
  std::vector<Symbol> symbols_;
  std::vector<Use> inputs_, outputs_;  // sorted by index
  std::unique_ptr<std::atomic<uint64_t>[]> calls_;  // symbols_.size() * slots()
};

}  // namespace ember
