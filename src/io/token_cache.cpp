// token_cache.cpp — FNV-1a hashing, checksums and the token cache file.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>

#include "attnres/data.hpp"
#include "attnres/error.hpp"
#include "attnres/fileio.hpp"

namespace attnres {

static_assert(std::endian::native == std::endian::little,
              "token caches are little-endian; big-endian hosts would need byte swapping");

namespace {
constexpr char kMagic[8] = {'A', 'R', 'T', 'O', 'K', 'C', 'C', 'H'};
constexpr char kRebuild[] = "; delete it to rebuild it from the corpus";
}  // namespace

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64, v);
  return buf;
}

uint64_t fnv1a64(std::string_view data, uint64_t seed) {
  uint64_t h = seed;
  for (unsigned char c : data) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

uint64_t checksum64(const void* p, uint64_t n, uint64_t h) {
  constexpr uint64_t kPrime = 0x100000001b3ULL;
  const auto* b = static_cast<const uint8_t*>(p);
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, b + i, 8);
    h = (h ^ w) * kPrime;
    h ^= h >> 32;
  }
  for (; i < n; i++) {
    h = (h ^ b[i]) * kPrime;
    h ^= h >> 32;
  }
  return h;
}

void write_token_cache(const std::string& path, const std::vector<int32_t>& tokens,
                       int32_t vocab_size, uint64_t key) {
  check(vocab_size > 0,
        "cannot write token cache '" + path + "' with vocab size " + std::to_string(vocab_size));
  for (size_t i = 0; i < tokens.size(); ++i) {
    check(tokens[i] >= 0 && tokens[i] < vocab_size,
          "cannot write token cache '" + path + "': token id " + std::to_string(tokens[i]) +
              " at index " + std::to_string(i) + " is outside the vocabulary [0," +
              std::to_string(vocab_size) + ")");
  }
  uint8_t header[kTokenCacheHeaderBytes] = {};
  const uint32_t version = kTokenCacheVersion, reserved = 0;
  const uint64_t count = tokens.size(), vocab = static_cast<uint64_t>(vocab_size);
  std::memcpy(header, kMagic, 8);
  std::memcpy(header + 8, &version, 4);
  std::memcpy(header + 12, &reserved, 4);
  std::memcpy(header + 16, &count, 8);
  std::memcpy(header + 24, &vocab, 8);
  std::memcpy(header + 32, &key, 8);
  const uint64_t sum = checksum64(tokens.data(), tokens.size() * sizeof(int32_t));
  std::memcpy(header + 40, &sum, 8);
  AtomicFileWriter w(path);
  w.write(header, sizeof(header));
  w.write(tokens.data(), tokens.size() * sizeof(int32_t));
  w.commit();
}

bool is_token_cache_file(const std::string& path) {
  const int fd = open_regular_file(path, O_RDONLY | O_CLOEXEC, "read");
  char magic[sizeof kMagic] = {};
  const ssize_t n = ::pread(fd, magic, sizeof magic, 0);
  ::close(fd);
  return n == static_cast<ssize_t>(sizeof magic) && std::memcmp(magic, kMagic, sizeof magic) == 0;
}

namespace {
// Reads up to n bytes at `offset` (retrying short reads); returns how many were read.
uint64_t read_at(int fd, void* out, uint64_t n, uint64_t offset) {
  uint64_t got = 0;
  while (got < n) {
    const ssize_t r =
        ::pread(fd, static_cast<char*>(out) + got, n - got, static_cast<off_t>(offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += static_cast<uint64_t>(r);
  }
  return got;
}
}  // namespace

TokenCache TokenCache::open(const std::string& path, uint64_t expected_key, int32_t vocab_size) {
  TokenCache tc;
  tc.path_ = path;
  const std::string f = "token cache '" + path + "'";
  // The header first, the ids straight into place after it is checked (a 3 GB file of junk was
  // read whole, then copied; nineteenth hostile pass).
  const int fd = open_regular_file(path, O_RDONLY | O_CLOEXEC, "read");
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  check(::fstat(fd, &st) == 0, "cannot read " + f + ": " + std::strerror(errno));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  uint8_t p[kTokenCacheHeaderBytes] = {};
  check(size >= kTokenCacheHeaderBytes &&
            read_at(fd, p, kTokenCacheHeaderBytes, 0) == kTokenCacheHeaderBytes,
        f + " is truncated (" + std::to_string(size) + " bytes, the header alone is " +
            std::to_string(kTokenCacheHeaderBytes) + ")" + kRebuild);
  check(std::memcmp(p, kMagic, 8) == 0,
        f + " is not a token cache (bad magic)" + std::string(kRebuild));
  uint32_t version;
  uint64_t count, vocab, key, sum;
  std::memcpy(&version, p + 8, 4);
  std::memcpy(&count, p + 16, 8);
  std::memcpy(&vocab, p + 24, 8);
  std::memcpy(&key, p + 32, 8);
  std::memcpy(&sum, p + 40, 8);
  check(version == kTokenCacheVersion, f + " has format version " + std::to_string(version) +
                                           ", expected " + std::to_string(kTokenCacheVersion) +
                                           kRebuild);
  // Compare via division so a hostile count cannot overflow the size computation.
  const uint64_t payload = size - kTokenCacheHeaderBytes;
  check(payload % 4 == 0 && count == payload / 4,
        f + " has the wrong size: header says " + std::to_string(count) +
            " tokens but the file "
            "holds " +
            std::to_string(payload) + " payload bytes (truncated?)" + kRebuild);
  check(vocab == static_cast<uint64_t>(vocab_size),
        f + " was built for vocab size " + std::to_string(vocab) + ", the tokenizer has " +
            std::to_string(vocab_size) + kRebuild);
  check(key == expected_key, f + " was built from a different corpus or tokenizer (key mismatch)" +
                                 std::string(kRebuild));
  tc.tokens_.resize(static_cast<size_t>(count));
  check(read_at(fd, tc.tokens_.data(), payload, kTokenCacheHeaderBytes) == payload,
        f + " is truncated (it shrank while read)" + std::string(kRebuild));

  // Every id is checked once here so the model's embedding lookup can trust them.
  const int32_t* t = tc.tokens_.data();
  const int64_t n = static_cast<int64_t>(count);
  int bad = 0;
#pragma omp parallel for reduction(| : bad) schedule(static)
  for (int64_t i = 0; i < n; ++i) bad |= (t[i] < 0 || t[i] >= vocab_size) ? 1 : 0;
  if (bad) {
    for (int64_t i = 0; i < n; ++i) {
      check(t[i] >= 0 && t[i] < vocab_size,
            f + " has token id " + std::to_string(t[i]) + " at index " + std::to_string(i) +
                ", outside the vocabulary [0," + std::to_string(vocab_size) + "); it is corrupt" +
                kRebuild);
    }
  }
  check(checksum64(tc.tokens_.data(), payload) == sum,
        f +
            " does not hold the tokens it was written with (checksum mismatch): it was altered "
            "or damaged" +
            std::string(kRebuild));
  return tc;
}

}  // namespace attnres
