// libFuzzer target for the package loader's parsing: container, section table, constants table,
// kernel images, meta lines and the IR text. The checksum is off (with it on, nearly every input
// stops at the first check), so the fuzzer reaches every bounds check behind it. Compiling the IR is
// left out: it hands arbitrary shapes to ATen, which is not what this target tests. The file-size
// field is set to the input's size, so that mutations which change the length get past that check too.
//
//   cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DEMBER_BUILD_FUZZER=ON
//   ninja -C build-fuzz package_fuzzer
//   python3 test/python/write_test_packages.py corpus/          # real packages as the seed corpus
//   ./build-fuzz/package_fuzzer corpus/ -max_total_time=300
//
// A finding is any crash, sanitizer report or exception other than ember::Error.
#include "backend/package/format.h"
#include "ember/error.h"
#include "ember/ir.h"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* input, size_t size) {
  std::vector<uint8_t> bytes(input, input + size);
  if (size >= 24) {
    uint64_t actual = size;
    std::memcpy(bytes.data() + 16, &actual, 8);
  }
  const uint8_t* data = bytes.data();
  try {
    ember::package::View view = ember::package::read(data, size, /*verify_checksum=*/false);
    for (const auto& c : view.constants) {
      // Every constant the reader accepts must lie inside the data section.
      volatile uint8_t sink = c.nbytes ? view.data[c.offset + c.nbytes - 1] : 0;
      (void)sink;
    }
    ember::parse(std::string(view.ir));
  } catch (const ember::Error&) {
  }
  return 0;
}
