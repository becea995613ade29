// max-autotune's timing of fused kernels' launches (launch_tuning.h).
#include "kernels/cuda/launch_tuning.h"

#include "backend/package/xxhash.h"
#include "kernels/cuda/disk_cache.h"
#include "kernels/cuda/driver.h"
#include "kernels/cuda/launch_record.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace ember::cuda {
namespace {

LaunchTimer& registered_timer() {
  static LaunchTimer timer;
  return timer;
}

std::string hex(uint64_t v) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(v));
  return text;
}

// "0.0123" ms as "12.3 us".
std::string micros(float ms) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f us", ms * 1000.f);
  return text;
}

}  // namespace

void register_launch_timer(const LaunchTimer& timer) { registered_timer() = timer; }

const LaunchTimer* launch_timer() {
  const LaunchTimer& t = registered_timer();
  return t.time_runs && t.flush_bytes && t.device_identity ? &t : nullptr;
}

LaunchTuner::LaunchTuner(Tuning tuning, const Program& program, const CudaSource& source, int device)
    : tuning_(std::move(tuning)), program_(program), source_(source), device_(device),
      source_hash_(hex(xxh64(reinterpret_cast<const uint8_t*>(source.text.data()), source.text.size(),
                             xxh64(reinterpret_cast<const uint8_t*>(source.strided_text.data()), source.strided_text.size(), 0)))) {}

// Everything the choice depends on besides the candidates' own checks: ember's version and this file's build
// (its timing or its rule for the winner may change), the device by name, the source, and what plan_call chose
// the launch from. "" where the device cannot be named (no record is read or written then).
std::string LaunchTuner::record_key(const CallPlan& plan) {
  const std::string device = launch_timer()->device_identity(device_);
  if (device.empty()) return "";
  std::string key = std::string("ember ") + EMBER_VERSION + " launch 1 built " + __DATE__ + " " + __TIME__ +
                    "\ndevice " + device + "\nsource " + source_hash_ + " " + std::to_string(source_.text.size()) +
                    "\nshape " + std::to_string(plan.numel) + " " + std::to_string(plan.rows) + " " +
                    std::to_string(plan.cols) + " entry " + std::to_string(plan.entry) + " masks";
  for (uint32_t m : plan.masks) key += " " + std::to_string(m);
  return key;
}

const LaunchChoice* LaunchTuner::keep(const CallPlan& plan, const LaunchChoice& choice, Report report) {
  const size_t n = count_.load(std::memory_order_relaxed);
  Shape& s = shapes_[n];
  s.numel = plan.numel;
  s.rows = plan.rows;
  s.cols = plan.cols;
  s.entry = plan.entry;
  std::copy(std::begin(plan.masks), std::end(plan.masks), s.masks);
  s.choice = choice;
  reports_.push_back(std::move(report));
  count_.store(n + 1, std::memory_order_release);
  return &s.choice;
}

const LaunchChoice* LaunchTuner::choose(const CallPlan& plan, const std::function<std::vector<LaunchChoice>()>& candidates,
                                        const std::function<bool(const LaunchChoice&)>& launch, void* stream) {
  const LaunchTimer* timer = launch_timer();
  if (!timer || capturing(stream)) return nullptr;  // a synchronizing timer cannot run in a capture
  std::lock_guard<std::mutex> lock(mu_);
  if (const LaunchChoice* c = find(plan)) return c;  // another thread chose while this one waited
  if (full()) return nullptr;
  const auto began = std::chrono::steady_clock::now();
  LaunchTuningCounters& counters = launch_tuning_counters();
  const LaunchChoice own = launch_of(plan);
  Report report;
  report.shape = program_.outer > 0         ? std::to_string(plan.cols) + "x" + std::to_string(plan.rows) + " columns"
                 : program_.has_reduction ? std::to_string(plan.rows) + "x" + std::to_string(plan.cols) + " rows"
                                          : std::to_string(plan.numel) + " elements";
  report.plan_call = launch_name(own, program_, source_);

  const std::string dir = disk_cache_dir();
  const std::string key = dir.empty() ? std::string() : record_key(plan);
  if (std::optional<LaunchRecord> r = key.empty() ? std::nullopt : launch_record_find(dir, key)) {
    const std::vector<LaunchChoice> offered = candidates();
    if (std::find(offered.begin(), offered.end(), r->choice) != offered.end()) {
      counters.from_disk.fetch_add(1);
      report.winner = launch_name(r->choice, program_, source_);
      report.how = "max-autotune, from disk";
      report.timings = std::move(r->timings);
      return keep(plan, r->choice, std::move(report));
    }
    counters.refused.fetch_add(1);
  }
  if (!tuning_.budget || !tuning_.budget->left()) {
    counters.over_budget.fetch_add(1);
    report.winner = report.plan_call;
    report.how = "default: budget spent";
    return keep(plan, own, std::move(report));
  }

  auto charged = began;
  auto charge = [&] {
    const auto now = std::chrono::steady_clock::now();
    tuning_.budget->spend(std::chrono::duration<double>(now - charged).count());
    charged = now;
  };
  const std::vector<LaunchChoice> offered = candidates();
  const at::Tensor flush = at::empty({std::max<int64_t>(timer->flush_bytes(device_), 1)},
                                     at::TensorOptions().device(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_))).dtype(at::kByte));
  LaunchChoice best = own;
  float best_ms = -1.f, own_ms = -1.f;
  bool cut_short = false;  // the budget ran out: this shape's best so far, not written to disk
  for (const LaunchChoice& c : offered) {
    charge();
    if (!report.timings.empty() && !tuning_.budget->left()) {
      cut_short = true;
      break;
    }
    const float give_up = best_ms >= 0.f ? std::max(4.f * best_ms, 0.05f) : -1.f;
    const float ms = timer->time_runs([&] { return launch(c); }, stream, flush.data_ptr(),
                                      static_cast<size_t>(flush.numel()), give_up);
    report.timings.emplace_back(launch_name(c, program_, source_), ms);
    if (ms < 0.f) continue;
    if (c == own) own_ms = ms;
    if (best_ms < 0.f || ms < best_ms) best = c, best_ms = ms;
  }
  charge();
  if (own_ms >= 0.f && best_ms > (1.f - kMinGain) * own_ms) best = own, best_ms = own_ms;
  counters.timed.fetch_add(1);
  report.winner = launch_name(best, program_, source_) + (best_ms >= 0.f ? " " + micros(best_ms) : "");
  report.how = cut_short ? "max-autotune, cut short by the budget" : "max-autotune";
  if (!cut_short && !key.empty() && best_ms >= 0.f) {
    LaunchRecord r;
    r.key = key;
    r.choice = best;
    r.winner = launch_name(best, program_, source_);
    r.timings = report.timings;
    launch_record_store(dir, r);  // best effort: a failed write costs the next process a timing
  }
  return keep(plan, best, std::move(report));
}

// "512x768 rows: w4 512t 132b 10.2 us (max-autotune); plan_call's w4 256t 528b 11.0 us; 24 timed: w4 512t 132b
// 10.2 us, ..., 14 more up to 40.1 us, 1 could not run": the fastest kListed by time.
std::vector<std::string> LaunchTuner::lines() const {
  static constexpr size_t kListed = 10;
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (const Report& r : reports_) {
    std::vector<std::pair<std::string, float>> ran;
    size_t failed = 0;
    float own_ms = -1.f;
    for (const auto& [name, ms] : r.timings) {
      if (ms < 0.f) ++failed;
      else ran.emplace_back(name, ms);
      if (name == r.plan_call) own_ms = ms;
    }
    std::sort(ran.begin(), ran.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
    std::string line = r.shape + ": " + r.winner + " (" + r.how + "); plan_call's " + r.plan_call +
                       (own_ms >= 0.f ? " " + micros(own_ms) : "");
    if (!r.timings.empty()) {
      line += "; " + std::to_string(r.timings.size()) + " timed: ";
      for (size_t i = 0; i < ran.size() && i < kListed; ++i) line += (i ? ", " : "") + ran[i].first + " " + micros(ran[i].second);
      if (ran.size() > kListed)
        line += ", ..., " + std::to_string(ran.size() - kListed) + " more up to " + micros(ran.back().second);
      if (failed) line += ", " + std::to_string(failed) + " could not run";
    }
    out.push_back(std::move(line));
  }
  return out;
}

}  // namespace ember::cuda
