// max-autotune's thread tuning of fused CPU kernels (kernels/cpu/thread_tuning.h), its logic alone: the winner
// rule, which caps are timed, the budget, and the table of shapes full at kMaxShapes. The kernels' results under
// it are checked against eager in test/python/test_autotune.py. And the records of CPU choices on disk
// (kernels/cpu/choice_record.h), read back exactly under their own key while no truncated, flipped or re-checksummed
// mutated file is read as a record of another key.
#include "kernels/cpu/thread_tuning.h"

#include "kernels/cpu/choice_record.h"
#include "test/cpp/record_bytes.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace ember::cpu {
namespace {

Tuning with_budget(double seconds) {
  Tuning t;
  t.exhaustive = true;
  t.budget = std::make_shared<TuningBudget>(seconds);
  return t;
}

ThreadShape shape_of(int64_t numel, int64_t threads = 8) { return ThreadShape{numel, 1, numel, 1, threads}; }

TEST(ThreadTuning, TheFastestWinsOnlyByThreePercent) {
  using T = ThreadTiming;
  EXPECT_EQ(ThreadTuner::winner({}), 0);
  EXPECT_EQ(ThreadTuner::winner({T{0, 100, 5}}), 0);
  EXPECT_EQ(ThreadTuner::winner({T{0, 100, 5}, T{1, 98, 5}}), 0);   // 2% faster: noise
  EXPECT_EQ(ThreadTuner::winner({T{0, 100, 5}, T{1, 96.9, 5}}), 1);
  EXPECT_EQ(ThreadTuner::winner({T{0, 100, 5}, T{1, 50, 5}, T{2, 40, 5}, T{4, 45, 5}}), 2);
  EXPECT_EQ(ThreadTuner::winner({T{0, 10, 5}, T{1, 40, 1}, T{2, 12, 5}}), 0);  // the default fastest
}

TEST(ThreadTuning, TimesTheDefaultFirstThenPowersOfTwoBelowWhatItTakes) {
  ThreadTuner tuner(with_budget(30), "");
  const ThreadShape shape = shape_of(1 << 20);
  std::vector<int64_t> caps;
  auto run = [&](int64_t cap) {
    caps.push_back(cap);
    return int64_t{6};  // the default's loops take 6 of the 8 threads
  };
  EXPECT_EQ(tuner.find(shape), ThreadTuner::kUnchosen);
  const int64_t chosen = tuner.choose(shape, "1048576 elements", run);
  ASSERT_FALSE(caps.empty());
  EXPECT_EQ(caps.front(), 0);
  std::vector<int64_t> distinct;
  for (int64_t c : caps)
    if (distinct.empty() || distinct.back() != c) distinct.push_back(c);
  EXPECT_EQ(distinct, (std::vector<int64_t>{0, 1, 2, 4}));  // each warmed up, then timed 5 or more times
  EXPECT_GE(caps.size(), 4u * 6u);
  EXPECT_TRUE(chosen == 0 || chosen == 1 || chosen == 2 || chosen == 4) << chosen;
  EXPECT_EQ(tuner.find(shape), chosen);

  // Chosen once: the shape is found, nothing runs again.
  caps.clear();
  EXPECT_EQ(tuner.choose(shape, "1048576 elements", run), chosen);
  EXPECT_TRUE(caps.empty());
  const std::vector<std::string> lines = tuner.lines();
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("1048576 elements on 8 threads: "), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("(max-autotune); timed: default 6 threads "), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("at most 4 threads "), std::string::npos) << lines[0];
}

TEST(ThreadTuning, ATenThreadCountBoundsTheCandidates) {
  ThreadTuner tuner(with_budget(30), "");
  std::vector<int64_t> caps;
  tuner.choose(shape_of(4096, 2), "4096 elements", [&](int64_t cap) {
    caps.push_back(cap);
    return int64_t{100};  // more tiles than threads
  });
  for (int64_t c : caps) EXPECT_TRUE(c == 0 || c == 1) << c;
  EXPECT_EQ(caps.back(), 1);
}

TEST(ThreadTuning, OneThreadsWorkIsNotTimed) {
  ThreadTuner tuner(with_budget(30), "");
  int runs = 0;
  EXPECT_EQ(tuner.choose(shape_of(100), "100 elements", [&](int64_t) { return ++runs, int64_t{1}; }), 0);
  EXPECT_EQ(runs, 1);  // the default's warm-up, which tells
  ASSERT_EQ(tuner.lines().size(), 1u);
  EXPECT_EQ(tuner.lines()[0], "100 elements on 8 threads: default (one thread's work: not timed)");
}

TEST(ThreadTuning, ASpentBudgetKeepsTheDefaultUntimedAndTheTableHoldsEightShapes) {
  for (Tuning tuning : {with_budget(0), Tuning{true, nullptr}}) {
    ThreadTuner tuner(tuning, "");
    int runs = 0;
    auto run = [&](int64_t) { return ++runs, int64_t{8}; };
    for (size_t i = 0; i < ThreadTuner::kMaxShapes; ++i) {
      EXPECT_FALSE(tuner.full());
      EXPECT_EQ(tuner.choose(shape_of(1000 + static_cast<int64_t>(i)), "n elements", run), 0);
    }
    EXPECT_EQ(runs, 0);
    EXPECT_TRUE(tuner.full());
    EXPECT_EQ(tuner.choose(shape_of(5000), "n elements", run), ThreadTuner::kUnchosen);
    EXPECT_EQ(tuner.find(shape_of(5000)), ThreadTuner::kUnchosen);
    for (size_t i = 0; i < ThreadTuner::kMaxShapes; ++i)
      EXPECT_EQ(tuner.find(shape_of(1000 + static_cast<int64_t>(i))), 0);
    EXPECT_EQ(tuner.find(shape_of(1000, 4)), ThreadTuner::kUnchosen);  // another thread count: another shape
    const std::vector<std::string> lines = tuner.lines();
    ASSERT_EQ(lines.size(), ThreadTuner::kMaxShapes);
    for (const std::string& line : lines) EXPECT_EQ(line, "n elements on 8 threads: default (default: budget spent)");
  }
}

TEST(ThreadTuning, ABudgetSpentWhileTimingKeepsTheBestSoFar) {
  ThreadTuner tuner(with_budget(0.001), "");
  std::vector<int64_t> caps;
  const int64_t chosen = tuner.choose(shape_of(1 << 20), "1048576 elements", [&](int64_t cap) {
    caps.push_back(cap);
    std::this_thread::sleep_for(std::chrono::microseconds(300));
    return int64_t{8};
  });
  EXPECT_EQ(chosen, 0);  // the default alone was timed
  for (int64_t c : caps) EXPECT_EQ(c, 0);
  ASSERT_EQ(tuner.lines().size(), 1u);
  const std::string line = tuner.lines()[0];
  EXPECT_NE(line.find(": default 8 threads (max-autotune, cut short by the budget); timed: default 8 threads "),
            std::string::npos) << line;
}

ChoiceRecord sample_record() {
  ChoiceRecord r;
  r.key = choice_record_host() + "fused kernel threads avx2 0123456789abcdef 812\nshape 1048576 1 1048576 path 1 threads 16";
  r.choice = 4;
  r.timings = {{"most", 16.f}, {"0", 0.25f}, {"1", 1.9f}, {"2", 0.98f}, {"4", 0.21f}, {"8", 0.23f}};
  return r;
}

using test::rechecksummed;

TEST(ChoiceRecord, RoundTripsUnderItsOwnKeyOnly) {
  const ChoiceRecord r = sample_record();
  const std::string bytes = choice_record_bytes(r);
  const std::optional<ChoiceRecord> back = parse_choice_record(bytes, r.key);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->key, r.key);
  EXPECT_EQ(back->choice, r.choice);
  EXPECT_EQ(back->timings, r.timings);
  EXPECT_FALSE(parse_choice_record(bytes, r.key + " "));
  EXPECT_FALSE(parse_choice_record(bytes, ""));
  std::string launch = bytes;  // another record kind's magic
  std::memcpy(&launch[0], "EMBERLCH", 8);
  EXPECT_FALSE(parse_choice_record(rechecksummed(launch), r.key));
}

TEST(ChoiceRecord, DamagedBytesAreMissesAndNeverAnotherKey) {
  const ChoiceRecord r = sample_record();
  const std::string good = choice_record_bytes(r);
  for (size_t n = 0; n < good.size(); ++n) EXPECT_FALSE(parse_choice_record(good.substr(0, n), r.key)) << n;
  for (size_t bit = 0; bit < good.size() * 8; ++bit) {
    std::string flipped = good;
    flipped[bit / 8] ^= static_cast<char>(1 << (bit % 8));
    EXPECT_FALSE(parse_choice_record(flipped, r.key)) << "bit " << bit;
  }
  std::mt19937_64 rng(61);
  for (int trial = 0; trial < 20000; ++trial) {
    const std::string bytes = test::mutated(good, rng);
    const std::optional<ChoiceRecord> back = parse_choice_record(rechecksummed(bytes), r.key);
    if (back) EXPECT_EQ(back->key, r.key);  // a changed choice is possible: its users check it before use
  }
}

}  // namespace
}  // namespace ember::cpu
