// deploy_cpp: loads an ember package, runs it on random inputs shaped by the package's input specs and
// prints the outputs and the timings (load, first run, steady state).
//
//   deploy_cpp model.ember [cpu|cuda|cuda:1] [iterations]
#include <ember/model.h>

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <iostream>

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

void synchronize(const c10::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

// A random tensor for one input spec: symbolic sizes take their value from the export's example inputs.
at::Tensor random_input(const ember::TensorSpec& spec, const ember::Model& model) {
  std::vector<int64_t> sizes;
  for (const ember::Dim& d : spec.type.sizes) {
    if (d.is_constant()) {
      sizes.push_back(d.value);
      continue;
    }
    int64_t value = -1;
    for (const ember::SymbolRange& s : model.symbols())
      if (s.name == d.expr) value = s.example;
    if (value < 0) throw ember::Error("input " + spec.name + " has size " + d.expr + "; give this program its own inputs");
    sizes.push_back(value);
  }
  auto options = at::TensorOptions().dtype(spec.type.dtype).device(model.device());
  if (at::isFloatingType(spec.type.dtype)) return torch::randn(sizes, options);
  if (spec.type.dtype == at::kBool) return torch::randint(0, 2, sizes, options);
  return torch::randint(0, 10, sizes, options);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s model.ember [cpu|cuda|cuda:N] [iterations]\n", argv[0]);
    return 2;
  }
  const c10::Device device(argc > 2 ? argv[2] : "cpu");
  const int iterations = argc > 3 ? std::atoi(argv[3]) : 100;
  try {
    // The CUDA context comes up first, so it is not counted as load time.
    if (device.is_cuda() && torch::cuda::is_available()) torch::empty({1}, torch::TensorOptions().device(device));
    auto start = Clock::now();
    ember::Model model = ember::load(argv[1], device);
    double load_ms = ms_since(start);
    for (const auto& [key, value] : model.metadata())
      if (key == "ember" || key == "torch" || key == "device" || key == "arch") std::printf("%s: %s\n", key.c_str(), value.c_str());
    std::vector<at::Tensor> inputs;
    for (const ember::TensorSpec& spec : model.inputs()) {
      inputs.push_back(random_input(spec, model));
      std::printf("input  %s  -> %s\n", spec.str().c_str(), c10::str(inputs.back().sizes()).c_str());
    }

    torch::NoGradGuard no_grad;
    start = Clock::now();
    std::vector<at::Tensor> outputs = model.run(inputs);
    synchronize(device);
    double first_ms = ms_since(start);
    for (int i = 0; i < 3; ++i) model.run(inputs);  // warm-up
    synchronize(device);
    start = Clock::now();
    for (int i = 0; i < iterations; ++i) outputs = model.run(inputs);
    synchronize(device);
    double steady_ms = ms_since(start) / std::max(iterations, 1);

    for (size_t i = 0; i < outputs.size(); ++i) {
      at::Tensor flat = outputs[i].detach().to(at::kCPU).to(at::kDouble).flatten();
      std::printf("output %zu: %s %s, first values:", i, c10::toString(outputs[i].scalar_type()),
                  c10::str(outputs[i].sizes()).c_str());
      for (int64_t k = 0; k < std::min<int64_t>(flat.numel(), 5); ++k) std::printf(" %.5f", flat[k].item<double>());
      std::printf("\n");
    }
    std::printf("load %.2f ms, first run %.3f ms, steady %.3f ms/run (%d runs)\n", load_ms, first_ms, steady_ms,
                iterations);
  } catch (const ember::Error& e) {  // a bad package or bad inputs: the message says what is wrong
    std::fprintf(stderr, "ember error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
