// 64-bit xxHash (XXH64): the checksum of deployment packages and of kernel disk-cache entries.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ember {

uint64_t xxh64(const uint8_t* bytes, size_t size, uint64_t seed);

}  // namespace ember
