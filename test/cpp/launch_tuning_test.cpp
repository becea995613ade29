// max-autotune's launch tuning of fused CUDA kernels without a GPU (kernels/cuda/launch_tuning.h): which launches
// a call may take (call_plan.h: launch_candidates, apply_launch) for flat, row and column groups, and the records
// of timed launches on disk (launch_record.h), read back exactly under their own key while no truncated, flipped,
// random or re-checksummed mutated file is read as a record of another key or as a launch no call takes.
#include "ember/compiler.h"
#include "kernels/cuda/call_plan.h"
#include "kernels/cuda/cuda_source.h"
#include "kernels/cuda/disk_cache.h"
#include "kernels/cuda/launch_record.h"
#include "kernels/program.h"
#include "passes/passes.h"
#include "test/cpp/record_bytes.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <random>
#include <set>
#include <tuple>

namespace ember {
namespace {

using cuda::LaunchChoice;

// The programs of `text`'s fusion groups, as codegen gets them.
std::vector<Program> programs_of(const std::string& text) {
  static std::deque<Graph> graphs;  // the programs point into their graph
  Graph& g = graphs.emplace_back(parse(text));
  CompileOptions options;
  PassContext ctx{options};
  eliminate_dead_code(g, ctx);
  fuse(g, ctx);
  std::vector<Program> out;
  for (int group = 0;; ++group) {
    std::string why;
    std::optional<Program> p = lower_group(g, group, &why);
    if (!p) break;
    out.push_back(std::move(*p));
  }
  return out;
}

// An H100-like device (132 multiprocessors): the general entry takes 1024 threads, the others 256; each entry
// holds `resident_at_256` blocks of 256 threads per multiprocessor (proportionally more of smaller ones).
cuda::LaunchLimits limits_with(size_t entries, int resident_at_256) {
  cuda::LaunchLimits limits;
  limits.multiprocessors = 132;
  for (size_t e = 0; e < entries; ++e) {
    limits.max_threads.push_back(e == 0 ? 1024 : 256);
    std::vector<int>& r = limits.resident.emplace_back();
    for (int threads = 32; threads <= 1024; threads += 32) r.push_back(threads <= 256 ? resident_at_256 * (256 / threads) : 1);
  }
  return limits;
}

// The call's plan (outputs on the CPU) with `inputs` in the program's input order.
cuda::CallPlan call(const Program& program, const cuda::CudaSource& source, std::vector<at::Tensor> inputs,
                    const cuda::LaunchLimits& limits) {
  std::vector<c10::IValue> buffers;
  std::vector<uint32_t> reads;
  for (at::Tensor& t : inputs) {
    reads.push_back(static_cast<uint32_t>(buffers.size()));
    buffers.emplace_back(t);
  }
  for (size_t s = 0; s < program.scalars.size(); ++s) {  // a size symbol's value: the first input's rows
    reads.push_back(static_cast<uint32_t>(buffers.size()));
    buffers.emplace_back(int64_t{inputs[0].size(0)});
  }
  std::vector<c10::ScalarType> out_dtypes;
  for (const ProgramOutput& o : program.outputs) out_dtypes.push_back(o.value->type.tensor.dtype);
  return cuda::plan_call(program, source, out_dtypes, buffers, reads, c10::Device(c10::kCPU), limits);
}

std::set<std::tuple<uint32_t, uint32_t, uint32_t, uint32_t>> as_set(const std::vector<LaunchChoice>& v) {
  std::set<std::tuple<uint32_t, uint32_t, uint32_t, uint32_t>> out;
  for (const LaunchChoice& c : v) out.emplace(c.entry, c.threads, c.blocks, c.splits);
  return out;
}

// plan_call's own launch first, no two alike.
void expect_well_formed(const std::vector<LaunchChoice>& candidates, const cuda::CallPlan& plan) {
  ASSERT_FALSE(candidates.empty());
  EXPECT_EQ(candidates[0], cuda::launch_of(plan));
  EXPECT_EQ(as_set(candidates).size(), candidates.size());
  for (const LaunchChoice& c : candidates) {
    EXPECT_GE(c.threads, 32u);
    EXPECT_LE(c.threads, 1024u);
    EXPECT_EQ(c.threads % 32, 0u);
    EXPECT_GE(c.blocks, 1u);
  }
}

// A flat group keeps the entry its pointers decide and takes 64 to 256 threads (the entry's most), each with every
// block the work fills and one wave.
TEST(LaunchCandidates, FlatGroupsVaryTheBlockAndTheGrid) {
  std::vector<Program> flat = programs_of(
      "graph(%x: f32[s0]{1}@cuda:0, %y: f32[s0]{1}@cuda:0, %s0: int):\n"
      "  %g: f32[s0]{1}@cuda:0 = aten::sigmoid(%x)\n"
      "  %m: f32[s0]{1}@cuda:0 = aten::mul.Tensor(%x, %g)\n"
      "  %a: f32[s0]{1}@cuda:0 = aten::add.Tensor(%m, %y)\n"
      "  return (%a)\n");
  ASSERT_EQ(flat.size(), 1u);
  const cuda::CudaSource source = cuda::generate(flat[0], "k");
  ASSERT_EQ(source.vector_width, 4);
  ASSERT_EQ(source.flat_unroll, 4);
  const cuda::LaunchLimits limits = limits_with(3, 3);
  const int64_t n = int64_t{1} << 24;  // 4M vectors
  cuda::CallPlan plan = call(flat[0], source, {at::randn({n}), at::randn({n})}, limits);
  ASSERT_EQ(cuda::launch_of(plan), (LaunchChoice{1, 256, 4096, 1}));
  EXPECT_EQ(plan.numel, n);
  std::vector<LaunchChoice> candidates = cuda::launch_candidates(plan, flat[0], source, limits);
  expect_well_formed(candidates, plan);
  // All blocks: 4M / (threads x 4 vectors); one wave: 132 x (3 x 256 / threads).
  EXPECT_EQ(as_set(candidates), as_set({{1, 256, 4096, 1}, {1, 64, 16384, 1}, {1, 64, 1584, 1}, {1, 128, 8192, 1},
                                        {1, 128, 792, 1}, {1, 256, 396, 1}}));
  EXPECT_EQ(cuda::launch_name(candidates[0], flat[0], source), "vec 256t 4096b");

  // A misaligned input: the strided vector entry, and only it.
  plan = call(flat[0], source, {at::randn({n}), at::randn({n + 1}).narrow(0, 1, n)}, limits);
  ASSERT_EQ(plan.entry, 2u);
  candidates = cuda::launch_candidates(plan, flat[0], source, limits);
  expect_well_formed(candidates, plan);
  for (const LaunchChoice& c : candidates) EXPECT_EQ(c.entry, 2u);
  EXPECT_EQ(cuda::launch_name(candidates[0], flat[0], source), "vec_strided 256t 4096b");

  // Applying a candidate changes the launch alone: the Params and outputs stay plan_call's.
  cuda::CallPlan applied = plan;
  cuda::apply_launch(applied, candidates.back(), source);
  EXPECT_EQ(cuda::launch_of(applied), candidates.back());
  EXPECT_EQ(applied.params, plan.params);
  EXPECT_TRUE(applied.outputs[0].is_same(plan.outputs[0]));

  // Nothing to compute: nothing but plan_call's (no launch).
  plan = call(flat[0], source, {at::randn({0}), at::randn({0})}, limits);
  ASSERT_FALSE(plan.launch);
  EXPECT_EQ(cuda::launch_candidates(plan, flat[0], source, limits).size(), 1u);
}

// A row group takes the register-resident variant its rows fit with 64 to 256 threads and the general kernel with
// 64 to 1024, each with one wave and every block; the general kernel only once it is compiled (the limits know it).
TEST(LaunchCandidates, RowGroupsVaryTheVariantTheBlockAndTheGrid) {
  std::vector<Program> rows = programs_of(
      "graph(%x: bf16[s0, 1024]{1024, 1}@cuda:0, %s0: int):\n"
      "  %a: bf16[s0, 1024]{1024, 1}@cuda:0 = aten::mul.Tensor(%x, 0.125)\n"
      "  %sm: bf16[s0, 1024]{1024, 1}@cuda:0 = aten::_softmax(%a, -1, false)\n"
      "  return (%sm)\n");
  ASSERT_EQ(rows.size(), 1u);
  const cuda::CudaSource source = cuda::generate(rows[0], "k");
  ASSERT_EQ(source.rows.size(), 1u);  // the row length is a constant: only w4 is compiled
  ASSERT_EQ(source.rows[0].mode, cuda::RowVariant::Mode::Warp);
  const cuda::LaunchLimits limits = limits_with(2, 4);
  const int64_t R = 32768;
  const cuda::CallPlan plan = call(rows[0], source, {at::randn({R, 1024}).to(at::kBFloat16)}, limits);
  ASSERT_EQ(cuda::launch_of(plan), (LaunchChoice{1, 256, 528, 1}));
  EXPECT_EQ(plan.rows, R);
  EXPECT_EQ(plan.cols, 1024);
  std::vector<LaunchChoice> candidates = cuda::launch_candidates(plan, rows[0], source, limits);
  expect_well_formed(candidates, plan);
  std::set<uint32_t> general_threads;
  for (const LaunchChoice& c : candidates) {
    EXPECT_LE(c.entry, 1u);
    if (c.entry == 1) {
      EXPECT_LE(c.threads, 256u);  // the variant's launch bound
    } else {
      general_threads.insert(c.threads);
    }
  }
  EXPECT_EQ(general_threads, (std::set<uint32_t>{64, 128, 256, 512, 1024}));
  const auto all = as_set(candidates);
  EXPECT_TRUE(all.count({1, 256, 4096, 1}));   // every block: 8 rows each
  EXPECT_TRUE(all.count({1, 64, 16384, 1}));   // 2 rows a block
  EXPECT_TRUE(all.count({1, 64, 2112, 1}));    // one wave of 16 per multiprocessor
  EXPECT_TRUE(all.count({0, 1024, R, 1}));     // the general kernel, a block per row
  EXPECT_TRUE(all.count({0, 1024, 132, 1}));   // and one wave
  EXPECT_EQ(all.size(), 6u + 10u);
  EXPECT_EQ(cuda::launch_name(candidates[0], rows[0], source), "w4 256t 528b");
  EXPECT_EQ(cuda::launch_name({0, 512, 132, 1}, rows[0], source), "general 512t 132b");

  // The general entry not compiled yet: the variant's launches alone.
  cuda::LaunchLimits unknown = limits;
  unknown.resident[0].clear();
  for (const LaunchChoice& c : cuda::launch_candidates(plan, rows[0], source, unknown)) EXPECT_EQ(c.entry, 1u);

  // Rows longer than the variant holds: plan_call takes the general kernel, and so do the candidates.
  std::vector<Program> symbolic = programs_of(
      "graph(%x: f32[s0, s1]{s1, 1}@cuda:0, %s0: int, %s1: int):\n"
      "  %a: f32[s0, s1]{s1, 1}@cuda:0 = aten::mul.Tensor(%x, 0.5)\n"
      "  %sm: f32[s0, s1]{s1, 1}@cuda:0 = aten::_softmax(%a, -1, false)\n"
      "  return (%sm)\n");
  ASSERT_EQ(symbolic.size(), 1u);
  const cuda::CudaSource every = cuda::generate(symbolic[0], "k");
  ASSERT_GT(every.rows.size(), 1u);  // a symbolic row length: every variant is compiled
  const cuda::LaunchLimits more = limits_with(1 + every.rows.size(), 4);
  const cuda::CallPlan wide = call(symbolic[0], every, {at::randn({64, 100000})}, more);
  ASSERT_EQ(wide.entry, 0u);
  for (const LaunchChoice& c : cuda::launch_candidates(wide, symbolic[0], every, more)) EXPECT_EQ(c.entry, 0u);
  // Short rows: each variant that holds them (the warp ones from w1 up, the block ones) beside the general kernel.
  const cuda::CallPlan narrow = call(symbolic[0], every, {at::randn({4096, 100})}, more);
  ASSERT_GT(narrow.entry, 0u);
  std::set<uint32_t> entries;
  for (const LaunchChoice& c : cuda::launch_candidates(narrow, symbolic[0], every, more)) {
    entries.insert(c.entry);
    if (c.entry > 0 && every.rows[c.entry - 1].mode == cuda::RowVariant::Mode::Block) {
      EXPECT_EQ(c.threads, static_cast<uint32_t>(cuda::block_threads(every.rows[c.entry - 1], 100, every.vector_width)));
    }
  }
  EXPECT_TRUE(entries.count(0));
  EXPECT_GT(entries.size(), 2u);
}

// A column group keeps its 256-thread blocks and varies the chunks the rows split into (half, twice, none) and,
// unsplit, one wave of tiles or all of them; applying one sets the Params' splits and chunk and the workspace.
TEST(LaunchCandidates, ColumnGroupsVaryTheChunksAndTheGrid) {
  std::vector<Program> cols = programs_of(
      "graph(%x: f32[s0, s1]{s1, 1}@cuda:0, %s0: int, %s1: int):\n"
      "  %a: f32[s0, s1]{s1, 1}@cuda:0 = aten::mul.Tensor(%x, 2.0)\n"
      "  %s: f32[s1]{1}@cuda:0 = aten::sum.dim_IntList(%a, [0])\n"
      "  return (%s)\n");
  ASSERT_EQ(cols.size(), 1u);
  ASSERT_GT(cols[0].outer, 0u);
  const cuda::CudaSource source = cuda::generate(cols[0], "k");
  const cuda::LaunchLimits limits = limits_with(1, 8);
  // A bias gradient: 768 columns (24 tiles) over 1024 rows, split in 16 chunks of 64.
  const cuda::CallPlan plan = call(cols[0], source, {at::randn({1024, 768})}, limits);
  ASSERT_EQ(cuda::launch_of(plan), (LaunchChoice{0, 256, 24, 16}));
  std::vector<LaunchChoice> candidates = cuda::launch_candidates(plan, cols[0], source, limits);
  expect_well_formed(candidates, plan);
  EXPECT_EQ(as_set(candidates), as_set({{0, 256, 24, 16}, {0, 256, 24, 8}, {0, 256, 24, 32}, {0, 256, 24, 1}}));
  EXPECT_EQ(cuda::launch_name(candidates[0], cols[0], source), "cols 256t 24b 16s");

  for (const LaunchChoice& c : candidates) {
    cuda::CallPlan applied = plan;
    cuda::apply_launch(applied, c, source);
    EXPECT_EQ(cuda::launch_of(applied), c);
    const int64_t* split_words = &applied.params[applied.workspace_word];
    EXPECT_EQ(split_words[2], c.splits);
    EXPECT_EQ(split_words[3], (1024 + c.splits - 1) / c.splits);  // every chunk holds rows
    EXPECT_EQ(applied.workspace_floats, c.splits > 1 ? int64_t{source.column_reductions} * c.splits * 768 : 0);
    EXPECT_EQ(applied.counters, c.splits > 1 ? 24 : 0);
    // The plan's own launch applied to it changes nothing.
    cuda::CallPlan back = applied;
    cuda::apply_launch(back, candidates[0], source);
    EXPECT_EQ(back.params, plan.params);
    EXPECT_EQ(back.workspace_floats, plan.workspace_floats);
    EXPECT_EQ(back.counters, plan.counters);
  }
  // Rows that do not divide evenly: no chunk is left empty (1000 rows in 32 wanted: 32 of 32, the last 8).
  const cuda::CallPlan odd = call(cols[0], source, {at::randn({1000, 768})}, limits);
  for (const LaunchChoice& c : cuda::launch_candidates(odd, cols[0], source, limits)) {
    const int64_t chunk = (1000 + c.splits - 1) / c.splits;
    EXPECT_LT((int64_t{c.splits} - 1) * chunk, 1000) << c.splits;
  }

  // More tiles than a wave (100000 columns, 3125 tiles against 132 x 8): never split, one wave or every tile.
  const cuda::CallPlan wide = call(cols[0], source, {at::randn({4, 100000})}, limits);
  EXPECT_EQ(as_set(cuda::launch_candidates(wide, cols[0], source, limits)), as_set({{0, 256, 1056, 1}, {0, 256, 3125, 1}}));
}

// ---- the records on disk

cuda::LaunchRecord sample() {
  cuda::LaunchRecord r;
  r.key = "ember 0.1.0 launch 1 built Dec  6 2026 12:00:00\ndevice NVIDIA H100 80GB HBM3 sm_90 132 SMs\n"
          "source 0123456789abcdef 5123\nshape 33554432 32768 1024 entry 1 masks 2147483649 0 0 0";
  r.choice = {1, 512, 264, 1};
  r.winner = "w4 512t 264b";
  r.timings = {{"w4 256t 528b", 0.0121f}, {"w4 512t 264b", 0.0110f}, {"general 1024t 32768b", 0.03f}, {"w4 64t 2112b", -1.f}};
  return r;
}

void expect_same(const cuda::LaunchRecord& a, const cuda::LaunchRecord& b) {
  EXPECT_EQ(a.key, b.key);
  EXPECT_EQ(a.choice, b.choice);
  EXPECT_EQ(a.winner, b.winner);
  EXPECT_EQ(a.timings, b.timings);
}

using test::rechecksummed;

TEST(LaunchRecord, RoundTripsUnderItsOwnKeyOnly) {
  const cuda::LaunchRecord r = sample();
  const std::string bytes = cuda::launch_record_bytes(r);
  const std::optional<cuda::LaunchRecord> back = cuda::parse_launch_record(bytes, r.key);
  ASSERT_TRUE(back.has_value());
  expect_same(*back, r);
  EXPECT_FALSE(cuda::parse_launch_record(bytes, r.key + " "));
  EXPECT_FALSE(cuda::parse_launch_record(bytes, r.key.substr(0, r.key.size() - 1)));
  EXPECT_FALSE(cuda::parse_launch_record(bytes, ""));
  // A GEMM record's magic is not a launch record's.
  std::string gemm = bytes;
  std::memcpy(&gemm[0], "EMBERGEM", 8);
  EXPECT_FALSE(cuda::parse_launch_record(rechecksummed(gemm), r.key));
  // Launches no call takes are damage, checksum or not.
  for (LaunchChoice bad : {LaunchChoice{1, 0, 264, 1}, LaunchChoice{1, 2048, 264, 1}, LaunchChoice{1, 512, 0, 1},
                           LaunchChoice{0, 256, 24, 0}, LaunchChoice{0, 256, 24, 70000}}) {
    cuda::LaunchRecord damaged = r;
    damaged.choice = bad;
    EXPECT_FALSE(cuda::parse_launch_record(cuda::launch_record_bytes(damaged), r.key));
  }
}

TEST(LaunchRecord, TruncatedOrFlippedBytesAreMisses) {
  const cuda::LaunchRecord r = sample();
  const std::string good = cuda::launch_record_bytes(r);
  for (size_t n = 0; n < good.size(); ++n)
    EXPECT_FALSE(cuda::parse_launch_record(good.substr(0, n), r.key)) << "truncated to " << n;
  EXPECT_FALSE(cuda::parse_launch_record(good + '\0', r.key));
  for (size_t bit = 0; bit < good.size() * 8; ++bit) {
    std::string flipped = good;
    flipped[bit / 8] ^= static_cast<char>(1 << (bit % 8));
    EXPECT_FALSE(cuda::parse_launch_record(flipped, r.key)) << "bit " << bit;
  }
}

TEST(LaunchRecord, MutatedBytesWithAValidChecksumNeverMisread) {
  const cuda::LaunchRecord r = sample();
  const std::string good = cuda::launch_record_bytes(r);
  std::mt19937_64 rng(61);
  for (int trial = 0; trial < 20000; ++trial) {
    const std::string bytes = test::mutated(good, rng);
    const std::optional<cuda::LaunchRecord> back = cuda::parse_launch_record(rechecksummed(bytes), r.key);
    if (!back) continue;
    EXPECT_EQ(back->key, r.key);  // a changed launch is possible; the tuner takes only one of the call's candidates
    EXPECT_TRUE(back->choice.threads >= 32 && back->choice.threads <= 1024 && back->choice.blocks >= 1 &&
                back->choice.splits >= 1 && back->choice.splits <= 65535);
  }
  for (int trial = 0; trial < 5000; ++trial) {  // random files, some starting like a record
    std::string bytes(rng() % 400, '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    if (trial % 2 && bytes.size() >= 12) std::memcpy(&bytes[0], good.data(), 12);
    EXPECT_FALSE(cuda::parse_launch_record(rechecksummed(bytes), r.key));
  }
}

TEST(LaunchRecord, StoredRecordIsFoundAndADamagedOneIsAMiss) {
  const char* tmp = std::getenv("TMPDIR");
  const std::string dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/ember_launch_record_test_" + std::to_string(::getpid());
  auto files = [&] {
    std::vector<std::string> out;
    if (DIR* d = ::opendir((dir + "/launch").c_str())) {
      while (dirent* e = ::readdir(d))
        if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) out.push_back(dir + "/launch/" + e->d_name);
      ::closedir(d);
    }
    return out;
  };
  auto clean = [&] {
    for (const std::string& f : files()) ::unlink(f.c_str());
    ::rmdir((dir + "/launch").c_str());
    ::rmdir(dir.c_str());
  };
  clean();
  const cuda::LaunchRecord r = sample();
  EXPECT_FALSE(cuda::launch_record_find(dir, r.key));
  ASSERT_TRUE(cuda::launch_record_store(dir, r));
  const std::vector<std::string> stored = files();
  ASSERT_EQ(stored.size(), 1u);  // no temporary file left behind
  const std::optional<cuda::LaunchRecord> found = cuda::launch_record_find(dir, r.key);
  ASSERT_TRUE(found.has_value());
  expect_same(*found, r);
  EXPECT_FALSE(cuda::launch_record_find(dir, r.key + " other"));
  EXPECT_FALSE(cuda::launch_record_find("", r.key));
  EXPECT_FALSE(cuda::launch_record_store("", r));
  const std::string good = *cuda::read_cache_file(stored[0]);
  ASSERT_TRUE(cuda::write_cache_file(dir + "/launch", stored[0].substr(stored[0].rfind('/') + 1), good.substr(0, good.size() / 2)));
  EXPECT_FALSE(cuda::launch_record_find(dir, r.key));
  clean();
}

}  // namespace
}  // namespace ember
