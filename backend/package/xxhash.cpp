// XXH64, the published algorithm (xxhash.com), written from its specification: four lanes of
// multiply-rotate rounds over 32-byte stripes, then the tail and a final avalanche. It checks packages
// and the kernel disk cache at several GB/s, so verifying a 45 MB package takes a few milliseconds.
#include "backend/package/xxhash.h"

#include <bit>
#include <cstring>

namespace ember {
namespace {

constexpr uint64_t P1 = 0x9E3779B185EBCA87ULL, P2 = 0xC2B2AE3D27D4EB4FULL, P3 = 0x165667B19E3779F9ULL,
                   P4 = 0x85EBCA77C2B2AE63ULL, P5 = 0x27D4EB2F165667C5ULL;

uint64_t load64(const uint8_t* p) { uint64_t v; std::memcpy(&v, p, 8); return v; }
uint32_t load32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
uint64_t round64(uint64_t acc, uint64_t input) { return std::rotl(acc + input * P2, 31) * P1; }
uint64_t merge64(uint64_t acc, uint64_t v) { return (acc ^ round64(0, v)) * P1 + P4; }

}  // namespace

uint64_t xxh64(const uint8_t* p, size_t size, uint64_t seed) {
  const uint8_t* const end = p + size;
  uint64_t h;
  if (size >= 32) {
    uint64_t v1 = seed + P1 + P2, v2 = seed + P2, v3 = seed, v4 = seed - P1;
    for (const uint8_t* limit = end - 32; p <= limit; p += 32) {
      v1 = round64(v1, load64(p));
      v2 = round64(v2, load64(p + 8));
      v3 = round64(v3, load64(p + 16));
      v4 = round64(v4, load64(p + 24));
    }
    h = std::rotl(v1, 1) + std::rotl(v2, 7) + std::rotl(v3, 12) + std::rotl(v4, 18);
    h = merge64(merge64(merge64(merge64(h, v1), v2), v3), v4);
  } else {
    h = seed + P5;
  }
  h += size;
  for (; p + 8 <= end; p += 8) h = std::rotl(h ^ round64(0, load64(p)), 27) * P1 + P4;
  if (p + 4 <= end) {
    h = std::rotl(h ^ (static_cast<uint64_t>(load32(p)) * P1), 23) * P2 + P3;
    p += 4;
  }
  for (; p < end; ++p) h = std::rotl(h ^ (*p * P5), 11) * P1;
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  h ^= h >> 32;
  return h;
}

}  // namespace ember
