// The tuned-GEMM records on disk (kernels/cuda/gemm_record.h) without a GPU: a record is read back exactly under
// its own key, and no truncated, flipped, random or re-checksummed mutated file is ever read as a record of
// another key or makes the reader run past its bytes.
#include "kernels/cuda/gemm_record.h"

#include "kernels/cuda/disk_cache.h"
#include "test/cpp/record_bytes.h"

#include <gtest/gtest.h>

#include <dirent.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace ember::cuda {
namespace {

GemmRecord sample() {
  GemmRecord r;
  r.key = "ember 0.1 record 1\ndevice NVIDIA H100 80GB HBM3 sm_90 132\ncublasLt 130100\nlevel exhaustive\n"
          "problem 512 768 3072 3072 1 1 768 f32 bias tf32 0 graphs 1";
  r.route = 1;
  r.config = 0;
  r.workspace = 1 << 20;
  for (size_t i = 0; i < r.algo.size(); ++i) r.algo[i] = static_cast<uint8_t>(i * 37 + 1);
  r.winner = "lt#1 split-K";
  r.timings = {{"lt#0", 0.061f}, {"lt#1 split-K", 0.055f}, {"aten", 0.07f}, {"kernel t16", -1.f}};
  return r;
}

void expect_same(const GemmRecord& a, const GemmRecord& b) {
  EXPECT_EQ(a.key, b.key);
  EXPECT_EQ(a.route, b.route);
  EXPECT_EQ(a.config, b.config);
  EXPECT_EQ(a.workspace, b.workspace);
  EXPECT_EQ(a.algo, b.algo);
  EXPECT_EQ(a.winner, b.winner);
  EXPECT_EQ(a.timings, b.timings);
}

using test::rechecksummed;

TEST(GemmRecord, RoundTripsUnderItsOwnKeyOnly) {
  const GemmRecord r = sample();
  const std::string bytes = gemm_record_bytes(r);
  const std::optional<GemmRecord> back = parse_gemm_record(bytes, r.key);
  ASSERT_TRUE(back.has_value());
  expect_same(*back, r);
  EXPECT_FALSE(parse_gemm_record(bytes, r.key + " "));
  EXPECT_FALSE(parse_gemm_record(bytes, r.key.substr(0, r.key.size() - 1)));
  EXPECT_FALSE(parse_gemm_record(bytes, ""));
  GemmRecord empty;  // no candidates, empty key: still a record
  ASSERT_TRUE(parse_gemm_record(gemm_record_bytes(empty), ""));
}

TEST(GemmRecord, TruncatedOrFlippedBytesAreMisses) {
  const GemmRecord r = sample();
  const std::string good = gemm_record_bytes(r);
  for (size_t n = 0; n < good.size(); ++n)
    EXPECT_FALSE(parse_gemm_record(good.substr(0, n), r.key)) << "truncated to " << n;
  EXPECT_FALSE(parse_gemm_record(good + '\0', r.key));
  for (size_t bit = 0; bit < good.size() * 8; ++bit) {
    std::string flipped = good;
    flipped[bit / 8] ^= static_cast<char>(1 << (bit % 8));
    EXPECT_FALSE(parse_gemm_record(flipped, r.key)) << "bit " << bit;
  }
}

TEST(GemmRecord, MutatedBytesWithAValidChecksumNeverMisread) {
  const GemmRecord r = sample();
  const std::string good = gemm_record_bytes(r);
  std::mt19937_64 rng(61);
  for (int trial = 0; trial < 20000; ++trial) {
    const std::string bytes = test::mutated(good, rng);
    const std::optional<GemmRecord> back = parse_gemm_record(rechecksummed(bytes), r.key);
    if (back) EXPECT_EQ(back->key, r.key);  // a changed winner is possible; gemm.cpp checks its meaning
  }
  for (int trial = 0; trial < 5000; ++trial) {  // random files, some starting like a record
    std::string bytes(rng() % 400, '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    if (trial % 2 && bytes.size() >= 12) std::memcpy(&bytes[0], good.data(), 12);
    EXPECT_FALSE(parse_gemm_record(rechecksummed(bytes), r.key));
  }
}

class GemmRecordDir : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TMPDIR");
    dir_ = std::string(tmp && *tmp ? tmp : "/tmp") + "/ember_gemm_record_test_" + std::to_string(::getpid());
    clean();
  }
  void TearDown() override { clean(); }

  std::vector<std::string> files() const {  // what <dir>/gemm holds
    std::vector<std::string> out;
    if (DIR* d = ::opendir((dir_ + "/gemm").c_str())) {
      while (dirent* e = ::readdir(d))
        if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0)
          out.push_back(dir_ + "/gemm/" + e->d_name);
      ::closedir(d);
    }
    return out;
  }
  void clean() {  // POSIX calls, as kernel_cache_test.cpp says why
    for (const std::string& f : files()) ::unlink(f.c_str());
    ::rmdir((dir_ + "/gemm").c_str());
    ::rmdir(dir_.c_str());
  }

  std::string dir_;
};

TEST_F(GemmRecordDir, StoredRecordIsFoundAndADamagedOneIsAMiss) {
  const GemmRecord r = sample();
  EXPECT_FALSE(gemm_record_find(dir_, r.key));
  ASSERT_TRUE(gemm_record_store(dir_, r));
  const std::vector<std::string> stored = files();
  ASSERT_EQ(stored.size(), 1u);  // no temporary file left behind
  EXPECT_EQ(stored[0].substr(stored[0].size() - 4), ".bin");
  const std::optional<GemmRecord> found = gemm_record_find(dir_, r.key);
  ASSERT_TRUE(found.has_value());
  expect_same(*found, r);
  GemmRecord other = r;
  other.key += " other";
  EXPECT_FALSE(gemm_record_find(dir_, other.key));
  EXPECT_FALSE(gemm_record_find("", r.key));
  EXPECT_FALSE(gemm_record_store("", r));

  const std::string good = *read_cache_file(stored[0]);
  ASSERT_TRUE(write_cache_file(dir_ + "/gemm", stored[0].substr(stored[0].rfind('/') + 1), good.substr(0, 40)));
  EXPECT_FALSE(gemm_record_find(dir_, r.key));
  ASSERT_TRUE(gemm_record_store(dir_, r));  // a later timing writes it again
  EXPECT_TRUE(gemm_record_find(dir_, r.key));
}

}  // namespace
}  // namespace ember::cuda
