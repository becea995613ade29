// Deployment packages, without Python: a package built here in C++ is loaded, validated against ATen,
// run from several threads, and damaged in every way a file can be (truncated, bit-flipped, another
// format version, another device or GPU architecture): each must give ember::Error, never a crash.
// Then the packages that test/python/write_test_packages.py exported (EMBER_PACKAGE_TEST_DIR) are
// loaded and compared with the eager outputs saved next to them.
#include "backend/package/export.h"
#include "backend/package/format.h"
#include "backend/package/xxhash.h"
#include "ember/model.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <thread>

namespace ember {
namespace {

constexpr const char* kIr =
    "graph(%x: f32[s0, 8]{8, 1}@cpu):\n"
    "  %w: f32[16, 8]{8, 1}@cpu = prim::constant(\"w\")\n"
    "  %b: f32[16]{1}@cpu = prim::constant(\"b\")\n"
    "  %t: f32[8, 16]{1, 8}@cpu = aten::t(%w)\n"
    "  %y: f32[s0, 16]{16, 1}@cpu = aten::addmm(%b, %x, %t)\n"
    "  %r: f32[s0, 16]{16, 1}@cpu = aten::relu(%y)\n"
    "  %z: f32[s0, 16]{16, 1}@cpu = aten::mul.Tensor(%r, 2.0)\n"
    "  return (%z)\n";

struct SmallPackage {
  at::Tensor w = at::randn({16, 8}), b = at::randn({16});
  package::Contents contents() const {
    package::Contents c;
    c.meta = {{"ember", "test"}, {"device", "cpu"}, {"symbol", "s0 1 64 4"}};
    c.ir = kIr;
    c.constants = {{"b", b}, {"w", w}};
    return c;
  }
  at::Tensor expected(const at::Tensor& x) const { return at::relu(at::addmm(b, x, w.t())) * 2.0; }
};

Model load_bytes(const std::string& bytes, c10::Device device = c10::kCPU, bool verify = true) {
  auto owner = std::make_shared<std::string>(bytes);
  LoadOptions options;
  options.verify_checksum = verify;
  return load_from_memory(std::shared_ptr<const void>(owner, owner->data()), owner->size(), device, options);
}

// Rewrites the checksum after a deliberate edit, so the loader gets past it to the check under test.
void reseal(std::string& bytes) {
  uint64_t sum = package::checksum(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  std::memcpy(bytes.data() + 24, &sum, 8);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Package, Xxh64KnownValues) {
  EXPECT_EQ(xxh64(nullptr, 0, 0), 0xEF46DB3751D8E999ULL);
  const std::string abc = "abc";
  EXPECT_EQ(xxh64(reinterpret_cast<const uint8_t*>(abc.data()), 3, 0), 0x44BC2CF5AD770999ULL);
}

TEST(Package, RoundTripMatchesAten) {
  SmallPackage p;
  std::string bytes = package::serialize(p.contents());
  Model model = load_bytes(bytes);
  ASSERT_EQ(model.inputs().size(), 1u);
  EXPECT_EQ(model.inputs()[0].str(), "x: f32[s0, 8]@cpu");
  for (int64_t batch : {1, 4, 37}) {
    at::Tensor x = at::randn({batch, 8});
    auto out = model.run({x});
    ASSERT_EQ(out.size(), 1u);
    EXPECT_TRUE(at::allclose(out[0], p.expected(x), 1e-5, 1e-5)) << "batch " << batch;
  }
  at::Tensor strided = at::randn({8, 6}).t();  // non-contiguous input
  EXPECT_TRUE(at::allclose(model.run({strided})[0], p.expected(strided), 1e-5, 1e-5));
}

TEST(Package, WeightsAreAlignedAndFileLoadMapsThem) {
  SmallPackage p;
  std::string path = (std::filesystem::temp_directory_path() / "ember_package_test.ember").string();
  package::write(path, p.contents());
  Model model = load(path);
  at::Tensor x = at::randn({5, 8});
  EXPECT_TRUE(at::allclose(model.run({x})[0], p.expected(x), 1e-5, 1e-5));
  std::string bytes = package::serialize(p.contents());
  auto view = package::read(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  for (const auto& c : view.constants) EXPECT_EQ(c.offset % package::kAlignment, 0u) << c.name;
  std::filesystem::remove(path);
}

TEST(Package, InputValidationMessages) {
  SmallPackage p;
  Model model = load_bytes(package::serialize(p.contents()));
  auto run = [&](std::vector<at::Tensor> in) { return error_of([&] { model.run(in); }); };
  EXPECT_NE(run({}).find("takes 1 inputs, got 0"), std::string::npos);
  EXPECT_NE(run({at::randn({4, 8}, at::kDouble)}).find("must be Float"), std::string::npos);
  EXPECT_NE(run({at::randn({4, 7})}).find("dimension 1 must be 8, got 7"), std::string::npos);
  EXPECT_NE(run({at::randn({4, 8, 1})}).find("must have 2 dimensions"), std::string::npos);
  EXPECT_NE(run({at::randn({65, 8})}).find("outside the range [1, 64]"), std::string::npos);
  EXPECT_NE(run({at::Tensor()}).find("undefined"), std::string::npos);
}

TEST(Package, SymbolsMustAgreeAcrossInputs) {
  package::Contents c;
  c.meta = {{"device", "cpu"}};
  c.ir =
      "graph(%a: f32[s0, 3]{3, 1}@cpu, %b: f32[s0, 3]{3, 1}@cpu, %c: f32[2*s0]{1}@cpu):\n"
      "  %y: f32[s0, 3]{3, 1}@cpu = aten::add.Tensor(%a, %b)\n"
      "  return (%y, %c)\n";
  Model model = load_bytes(package::serialize(c));
  at::Tensor a = at::randn({4, 3}), b = at::randn({4, 3});
  EXPECT_TRUE(at::allclose(model.run({a, b, at::randn({8})})[0], a + b));
  std::string e = error_of([&] { model.run({a, at::randn({5, 3}), at::randn({8})}); });
  EXPECT_NE(e.find("but s0 is 4 in input 0 (a)"), std::string::npos) << e;
  e = error_of([&] { model.run({a, b, at::randn({9})}); });
  EXPECT_NE(e.find("must be 2*s0 = 8, got 9"), std::string::npos) << e;
}

TEST(Package, RunFromSeveralThreads) {
  SmallPackage p;
  Model model = load_bytes(package::serialize(p.contents()));
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) {
        at::Tensor x = at::randn({1 + (t * 7 + i) % 13, 8});
        if (!at::allclose(model.run({x})[0], p.expected(x), 1e-5, 1e-5)) ++failures;
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
}

// Every truncation and every bit flip of a real package must be an ember::Error: the checksum sees
// every flip, and the size check every truncation.
TEST(Package, CorruptionAlwaysThrowsCleanly) {
  SmallPackage p;
  const std::string good = package::serialize(p.contents());
  std::mt19937_64 rng(6);
  std::vector<size_t> lengths = {0, 1, 7, 8, 63, 64, 65, good.size() - 1, good.size() / 2};
  for (int i = 0; i < 200; ++i) lengths.push_back(rng() % good.size());
  for (size_t n : lengths) {
    std::string cut = good.substr(0, n);
    EXPECT_THROW(load_bytes(cut), Error) << "truncated to " << n;
  }
  std::vector<size_t> bits;
  for (size_t b = 0; b < 64 * 8; ++b) bits.push_back(b);  // every bit of the header
  for (int i = 0; i < 2000; ++i) bits.push_back(rng() % (good.size() * 8));
  for (size_t bit : bits) {
    std::string flipped = good;
    flipped[bit / 8] ^= static_cast<char>(1 << (bit % 8));
    EXPECT_THROW(load_bytes(flipped), Error) << "bit " << bit;
  }
}

// With the checksum off (as the fuzzer runs), damage must still never crash or read out of bounds:
// the parser's own checks stop it, or the damage was harmless (in the weights) and the model loads.
TEST(Package, UnverifiedDamageNeverEscapesAsAnotherException) {
  SmallPackage p;
  const std::string good = package::serialize(p.contents());
  std::mt19937_64 rng(7);
  for (int i = 0; i < 1500; ++i) {
    std::string bad = good;
    if (i % 3 == 0) bad.resize(rng() % good.size());
    int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips && !bad.empty(); ++f) bad[rng() % bad.size()] ^= static_cast<char>(1 << (rng() % 8));
    try {
      load_bytes(bad, c10::kCPU, /*verify=*/false);
    } catch (const Error&) {
    } catch (const std::exception& e) {
      ADD_FAILURE() << "case " << i << ": not an ember::Error: " << e.what();
    }
  }
}

TEST(Package, WrongFormatVersionSaysSo) {
  SmallPackage p;
  std::string bytes = package::serialize(p.contents());
  uint32_t version = package::kFormatVersion + 1;
  std::memcpy(bytes.data() + 8, &version, 4);
  reseal(bytes);
  EXPECT_NE(error_of([&] { load_bytes(bytes); }).find("format version 2"), std::string::npos);
}

TEST(Package, WrongDeviceOrArchitectureSaysSo) {
  SmallPackage p;
  std::string e = error_of([&] { load_bytes(package::serialize(p.contents()), c10::Device(c10::kCUDA, 0)); });
  EXPECT_NE(e.find("exported for cpu and cannot run on cuda"), std::string::npos) << e;

  // A CUDA package whose kernels were compiled for an architecture no GPU has.
  package::Contents c = p.contents();
  c.meta = {{"device", "cuda:0"}};
  std::string ir = kIr;
  for (size_t at = ir.find("@cpu"); at != std::string::npos; at = ir.find("@cpu", at)) ir.replace(at, 4, "@cuda:0");
  c.ir = ir;
  c.kernels.push_back(cuda::KernelImage{"sm_1", "extern \"C\" __global__ void f() {}", "not a cubin", "0.0"});
  std::string bytes = package::serialize(c);
  e = error_of([&] { load_bytes(bytes, c10::Device(c10::kCUDA, 0)); });
  EXPECT_FALSE(e.empty());
  if (at::hasCUDA()) EXPECT_NE(e.find("compiled for sm_1"), std::string::npos) << e;
  e = error_of([&] { load_bytes(bytes, c10::kCPU); });
  EXPECT_NE(e.find("exported for cuda:0 and cannot run on cpu"), std::string::npos) << e;
}

// A CUDA package keeps a CPU scalar constant on the CPU (as its IR declares) and moves the rest.
TEST(Package, CudaPackagePlacesConstantsAsDeclared) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs CUDA";
  package::Contents c;
  c.meta = {{"device", "cuda:0"}};
  c.ir =
      "graph(%x: f32[5]{1}@cuda:0):\n"
      "  %c: f32[]{}@cpu = prim::constant(\"c\")\n"
      "  %w: f32[5]{1}@cuda:0 = prim::constant(\"w\")\n"
      "  %y: f32[5]{1}@cuda:0 = aten::mul.Tensor(%x, %c)\n"
      "  %z: f32[5]{1}@cuda:0 = aten::add.Tensor(%y, %w)\n"
      "  return (%z)\n";
  at::Tensor scalar = at::scalar_tensor(3.0), w = at::randn({5});
  c.constants = {{"c", scalar}, {"w", w.cuda()}};
  Model model = load_bytes(package::serialize(c), c10::Device(c10::kCUDA, 0));
  at::Tensor x = at::randn({5}, at::kCUDA);
  at::Tensor out = model.run({x})[0];
  EXPECT_TRUE(out.is_cuda());
  EXPECT_TRUE(at::allclose(out.cpu(), x.cpu() * 3.0 + w, 1e-5, 1e-5));
}

TEST(Package, ReduceOverheadOnTheCpuIsAClearError) {
  SmallPackage p;
  std::string bytes = package::serialize(p.contents());
  auto owner = std::make_shared<std::string>(bytes);
  LoadOptions options;
  options.reduce_overhead = true;
  try {
    load_from_memory(std::shared_ptr<const void>(owner, owner->data()), owner->size(), c10::kCPU, options);
    FAIL() << "reduce_overhead on a CPU package loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs a CUDA device"), std::string::npos) << e.what();
  }
}

// ---- packages exported from Python (test/python/write_test_packages.py); no Python runs here.

std::vector<char> read_file(const std::filesystem::path& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

std::vector<at::Tensor> tensors_of(const c10::IValue& v) {
  std::vector<at::Tensor> out;
  for (const c10::IValue& t : v.toListRef()) out.push_back(t.toTensor());
  return out;
}

TEST(Package, ExportedPackagesMatchEager) {
  const char* dir_env = std::getenv("EMBER_PACKAGE_TEST_DIR");
  if (!dir_env || !std::filesystem::exists(std::filesystem::path(dir_env) / "manifest.txt"))
    GTEST_SKIP() << "EMBER_PACKAGE_TEST_DIR is not set or has no manifest.txt: run "
                    "python3 test/python/write_test_packages.py DIR first (test/run_all.sh does)";
  std::filesystem::path dir(dir_env);
  std::ifstream manifest(dir / "manifest.txt");
  std::string name, device;
  double rtol = 0, atol = 0;
  int checked = 0;
  while (manifest >> name >> device >> rtol >> atol) {
    SCOPED_TRACE(name + " on " + device);
    // The expected outputs were computed with TF32 off (write_test_packages.py); cuDNN defaults to it.
    at::globalContext().setAllowTF32CuDNN(false);
    at::globalContext().setAllowTF32CuBLAS(false);
    Model model = load((dir / (name + ".ember")).string(), c10::Device(device));
    // cases.pt: [[inputs...], [expected outputs...]] per case
    c10::IValue cases = torch::pickle_load(read_file(dir / (name + ".cases.pt")));
    for (const c10::IValue& c : cases.toListRef()) {
      const auto& pair = c.toListRef();
      std::vector<at::Tensor> inputs = tensors_of(pair[0]), expected = tensors_of(pair[1]);
      for (at::Tensor& x : inputs) x = x.to(model.device());
      std::vector<at::Tensor> out = model.run(inputs);
      ASSERT_EQ(out.size(), expected.size());
      for (size_t i = 0; i < out.size(); ++i)
        EXPECT_TRUE(at::allclose(out[i].cpu(), expected[i], rtol, atol))
            << "output " << i << " max diff " << (out[i].cpu() - expected[i]).abs().max().item<double>();
    }
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

TEST(Package, SubgraphsTravelInTheIrSection) {
  // The graph's text, then each subgraph's after its marker line; split_graphs gives back what join_graphs took.
  using package::GraphTexts;
  const std::string top = "graph(%x: f32[2]{1}@cpu):\n  return (%x)\n";
  const GraphTexts subs = {{"t", "graph(%a: f32[2]{1}@cpu):\n  return (%a)\n"},
                           {"t/inner", "graph(%b: f32[2]{1}@cpu):\n  return (%b)\n"}};
  const std::string section = package::join_graphs(top, subs);
  auto [graph, subgraphs] = package::split_graphs(section);
  EXPECT_EQ(graph, top);
  EXPECT_EQ(subgraphs, subs);
  EXPECT_THROW(package::split_graphs(top + "subgraph \"\n"), Error);
  EXPECT_THROW(package::join_graphs(top, {{"a\"b", "graph():\n  return ()\n"}}), Error);
}

}  // namespace
}  // namespace ember
