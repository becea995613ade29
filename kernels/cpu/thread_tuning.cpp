// max-autotune's timing of fused CPU kernels' thread counts (thread_tuning.h).
#include "kernels/cpu/thread_tuning.h"

#include "kernels/cpu/choice_record.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>

namespace ember::cpu {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kMinRuns = 5, kMaxRuns = 25;
constexpr double kFillMs = 2.0;  // timed runs per candidate: enough to fill this, within [kMinRuns, kMaxRuns]

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

bool same(const ThreadShape& a, const ThreadShape& b) {
  return a.numel == b.numel && a.rows == b.rows && a.cols == b.cols && a.path == b.path && a.threads == b.threads;
}

std::string threads_text(int64_t n) { return std::to_string(n) + (n == 1 ? " thread" : " threads"); }

// "0.0123" ms as "12.3 us".
std::string micros(double ms) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f us", ms * 1000.0);
  return text;
}

}  // namespace

ThreadTuner::ThreadTuner(Tuning tuning, std::string identity)
    : tuning_(std::move(tuning)), identity_(std::move(identity)) {}

std::string ThreadTuner::record_key(const ThreadShape& s) const {
  return choice_record_host() + "fused kernel threads " + identity_ + "\nshape " + std::to_string(s.numel) + " " +
         std::to_string(s.rows) + " " + std::to_string(s.cols) + " path " + std::to_string(s.path) + " threads " +
         std::to_string(s.threads);
}

int64_t ThreadTuner::find(const ThreadShape& shape) const {
  const size_t n = count_.load(std::memory_order_acquire);
  for (size_t i = 0; i < n; ++i)
    if (same(shapes_[i], shape)) return caps_[i];
  return kUnchosen;
}

bool ThreadTuner::full() const { return count_.load(std::memory_order_acquire) == kMaxShapes; }

int64_t ThreadTuner::winner(const std::vector<ThreadTiming>& timings) {
  if (timings.empty()) return 0;
  const ThreadTiming* best = &timings[0];
  for (const ThreadTiming& t : timings)
    if (t.ms < best->ms) best = &t;
  return best->ms <= (1.0 - kMinGain) * timings[0].ms ? best->cap : 0;
}

int64_t ThreadTuner::keep(const ThreadShape& shape, int64_t cap, Report report) {
  const size_t n = count_.load(std::memory_order_relaxed);
  shapes_[n] = shape;
  caps_[n] = cap;
  report.cap = cap;
  reports_.push_back(std::move(report));
  count_.store(n + 1, std::memory_order_release);
  return cap;
}

int64_t ThreadTuner::choose(const ThreadShape& shape, const std::string& what,
                            const std::function<int64_t(int64_t)>& run) {
  std::lock_guard<std::mutex> lock(mu_);
  if (const int64_t cap = find(shape); cap != kUnchosen) return cap;  // another thread chose while this one waited
  if (full()) return kUnchosen;
  Report report;
  report.what = what;
  report.threads = shape.threads;
  const std::string key = identity_.empty() ? std::string() : record_key(shape);
  if (std::optional<ChoiceRecord> r = key.empty() ? std::nullopt : choice_record_find(key)) {
    if (r->choice >= 0 && r->choice < shape.threads) {
      cpu_tuning_counters().from_disk.fetch_add(1);
      report.how = "max-autotune, from disk";
      for (const auto& [name, ms] : r->timings) {
        if (name == "most") report.most = static_cast<int64_t>(ms);
        else report.timings.push_back({std::atoll(name.c_str()), ms, 0});
      }
      return keep(shape, r->choice, std::move(report));
    }
    cpu_tuning_counters().refused.fetch_add(1);
  }
  if (!tuning_.budget || !tuning_.budget->left()) {
    report.how = "default: budget spent";
    return keep(shape, 0, std::move(report));
  }

  auto charged = Clock::now();
  auto charge = [&] {
    const auto now = Clock::now();
    tuning_.budget->spend(std::chrono::duration<double>(now - charged).count());
    charged = now;
  };
  // The warm-up run, then the median of the timed ones; only the warm-up where it took over `give_up_ms`.
  auto time = [&](int64_t cap, double warm_ms, double give_up_ms) {
    if (give_up_ms >= 0 && warm_ms > give_up_ms) return ThreadTiming{cap, warm_ms, 1};
    const int runs = static_cast<int>(std::clamp(kFillMs / std::max(warm_ms, 1e-4), double(kMinRuns),
                                                 double(kMaxRuns)));
    std::vector<double> ms(static_cast<size_t>(runs));
    for (double& m : ms) {
      const auto began = Clock::now();
      run(cap);
      m = ms_since(began);
    }
    std::nth_element(ms.begin(), ms.begin() + runs / 2, ms.end());
    return ThreadTiming{cap, ms[runs / 2], runs};
  };

  auto began = Clock::now();
  const int64_t most = std::min(run(0), shape.threads);  // the default's warm-up
  const double default_warm = ms_since(began);
  if (most <= 1) {
    charge();
    report.how = "one thread's work: not timed";
    return keep(shape, 0, std::move(report));
  }
  report.most = most;
  report.timings.push_back(time(0, default_warm, -1));
  double best_ms = report.timings[0].ms;
  bool cut_short = false;
  for (int64_t cap = 1; cap < most; cap *= 2) {
    charge();
    if (!tuning_.budget->left()) {
      cut_short = true;
      break;
    }
    began = Clock::now();
    run(cap);
    const ThreadTiming t = time(cap, ms_since(began), std::max(4 * best_ms, 0.05));
    report.timings.push_back(t);
    best_ms = std::min(best_ms, t.ms);
  }
  charge();
  const int64_t cap = winner(report.timings);
  cpu_tuning_counters().timed.fetch_add(1);
  report.how = cut_short ? "max-autotune, cut short by the budget" : "max-autotune";
  if (!cut_short && !key.empty()) {  // one cut short is timed whole by a later process
    ChoiceRecord record{key, cap, {{"most", float(most)}}};
    for (const ThreadTiming& t : report.timings) record.timings.emplace_back(std::to_string(t.cap), float(t.ms));
    choice_record_store(record);
  }
  return keep(shape, cap, std::move(report));
}

std::vector<std::string> ThreadTuner::lines() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (const Report& r : reports_) {
    auto name = [&](int64_t cap) {
      return cap ? "at most " + threads_text(cap) : r.most ? "default " + threads_text(r.most) : std::string("default");
    };
    std::string line = r.what + " on " + threads_text(r.threads) + ": " + name(r.cap) + " (" + r.how + ")";
    for (size_t i = 0; i < r.timings.size(); ++i) {
      const ThreadTiming& t = r.timings[i];
      line += (i ? ", " : "; timed: ") + name(t.cap) + " " + micros(t.ms) + (t.runs == 1 ? " (one run)" : "");
    }
    out.push_back(std::move(line));
  }
  return out;
}

}  // namespace ember::cpu
