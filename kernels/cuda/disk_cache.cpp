// Entry file: "EMBERCUB", u32 layout version, then length-prefixed (u64) ember version, arch, NVRTC
// version, source and image, then the XXH64 of everything before it. Named by the XXH64 of the key.
#include "kernels/cuda/disk_cache.h"

#include "backend/package/xxhash.h"
#include "ember/config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <thread>

namespace ember::cuda {
namespace {

constexpr char kMagic[8] = {'E', 'M', 'B', 'E', 'R', 'C', 'U', 'B'};
constexpr uint32_t kLayoutVersion = 1;
// Part of every key: a new ember may print the same source for a different calling convention.
constexpr const char* kEmberVersion = EMBER_VERSION;

uint64_t hash_of(const std::string& s, uint64_t seed) {
  return xxh64(reinterpret_cast<const uint8_t*>(s.data()), s.size(), seed);
}

std::string entry_name(const std::string& arch, const std::string& nvrtc_version, const std::string& source) {
  uint64_t h = hash_of(source, hash_of(arch + "\n" + nvrtc_version + "\n" + kEmberVersion, 0));
  char name[32];
  std::snprintf(name, sizeof(name), "%016llx.cubin", static_cast<unsigned long long>(h));
  return name;
}

// mkdir -p with POSIX calls. std::filesystem is avoided in libember: torch 2.11's libtorch.so exports its
// own std::filesystem symbols, which calls from here bind to, and std::filesystem::remove_all crashed
// through them on the GPU machine.
void make_directories(const std::string& dir) {
  for (size_t i = 1; i <= dir.size(); ++i)
    if (i == dir.size() || dir[i] == '/') {
      std::string prefix = dir.substr(0, i);
      if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) return;
    }
}

void put_string(std::string& out, const std::string& s) {
  uint64_t n = s.size();
  out.append(reinterpret_cast<const char*>(&n), 8);
  out += s;
}

// Reads a length-prefixed string at *pos of `bytes`; false if it does not fit.
bool get_string(const std::string& bytes, size_t end, size_t* pos, std::string* out) {
  uint64_t n = 0;
  if (end - *pos < 8) return false;
  std::memcpy(&n, bytes.data() + *pos, 8);
  *pos += 8;
  if (n > end - *pos) return false;
  out->assign(bytes, *pos, n);
  *pos += n;
  return true;
}

}  // namespace

std::string disk_cache_dir() {
  if (const std::optional<std::string> dir = config_value("EMBER_CACHE_DIR")) {
    const std::string& d = *dir;
    return d == "off" || d == "0" ? "" : d;
  }
  const char* home = std::getenv("HOME");
  return home && *home ? std::string(home) + "/.cache/ember" : "";
}

std::optional<KernelImage> disk_cache_find(const std::string& dir, const std::string& arch,
                                           const std::string& nvrtc_version, const std::string& source) {
  if (dir.empty()) return std::nullopt;
  const std::optional<std::string> read = read_cache_file(dir + "/" + entry_name(arch, nvrtc_version, source));
  if (!read) return std::nullopt;
  const std::string& bytes = *read;
  if (bytes.size() < 8 + 4 + 8) return std::nullopt;
  size_t body = bytes.size() - 8;
  uint64_t stored = 0;
  std::memcpy(&stored, bytes.data() + body, 8);
  uint32_t version = 0;
  std::memcpy(&version, bytes.data() + 8, 4);
  if (std::memcmp(bytes.data(), kMagic, 8) != 0 || version != kLayoutVersion ||
      xxh64(reinterpret_cast<const uint8_t*>(bytes.data()), body, 0) != stored)
    return std::nullopt;
  size_t pos = 12;
  std::string ember_version;
  KernelImage image;
  if (!get_string(bytes, body, &pos, &ember_version) || !get_string(bytes, body, &pos, &image.arch) ||
      !get_string(bytes, body, &pos, &image.nvrtc_version) || !get_string(bytes, body, &pos, &image.source) ||
      !get_string(bytes, body, &pos, &image.image) || pos != body)
    return std::nullopt;
  if (ember_version != kEmberVersion || image.arch != arch || image.nvrtc_version != nvrtc_version ||
      image.source != source || image.image.empty())
    return std::nullopt;
  return image;
}

bool disk_cache_store(const std::string& dir, const KernelImage& image) {
  if (dir.empty()) return false;
  std::string bytes(kMagic, 8);
  bytes.append(reinterpret_cast<const char*>(&kLayoutVersion), 4);
  put_string(bytes, kEmberVersion);
  put_string(bytes, image.arch);
  put_string(bytes, image.nvrtc_version);
  put_string(bytes, image.source);
  put_string(bytes, image.image);
  uint64_t sum = xxh64(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), 0);
  bytes.append(reinterpret_cast<const char*>(&sum), 8);
  return write_cache_file(dir, entry_name(image.arch, image.nvrtc_version, image.source), bytes);
}

std::optional<std::string> read_cache_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return std::nullopt;
  std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) return std::nullopt;
  return bytes;
}

bool write_cache_file(const std::string& dir, const std::string& name, const std::string& bytes) {
  make_directories(dir);
  std::string path = dir + "/" + name;
  // Unique per process and thread, so concurrent writers of one entry never share a temporary file.
  std::string tmp = path + ".tmp" + std::to_string(::getpid()) + "_" +
                    std::to_string(std::hash<std::thread::id>()(std::this_thread::get_id()));
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) return false;
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    f.close();
    if (!f) {
      ::unlink(tmp.c_str());
      return false;
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) == 0) return true;
  ::unlink(tmp.c_str());
  return false;
}

}  // namespace ember::cuda
