// fileio.cpp — POSIX implementation of read_file, the atomic writers and MappedFile.
#include "attnres/fileio.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <utility>
#include <vector>

#include "attnres/error.hpp"

namespace attnres {

namespace {

// Directory part of a path, for the fsync that makes a rename durable.
std::string dir_of(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// Unique temp suffix per writer: the pid keeps concurrent processes apart, the counter keeps
// concurrent writers to the same path inside one process apart.
std::string temp_name_for(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
}

// Hint appended to write failures so the user knows what to do about the common causes.
std::string write_fix_hint(int err) {
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      return "free disk space or write to another directory";
    case EFBIG:
      return "the file size limit (ulimit -f) or filesystem maximum was hit; raise it or write "
             "elsewhere";
    case EACCES:
    case EPERM:
    case EROFS:
      return "check that the directory is writable";
    case ENOENT:
    case ENOTDIR:
      return "create the directory first or fix the path";
    default:
      return "check the disk and the path";
  }
}

// What a file that is not a regular one is, for errors.
const char* kind_of(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO (named pipe)";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

// procfs, sysfs, debugfs, tracefs, securityfs, cgroup v1/v2, configfs, bpf (linux/magic.h).
bool is_kernel_interface(long type) {
  for (long magic : {0x9fa0L, 0x62656572L, 0x64626720L, 0x74726163L, 0x73636673L, 0x27e0ebL,
                     0x63677270L, 0x62656570L, 0xcafe4a11L}) {
    if (type == magic) return true;
  }
  return false;
}

// Closes a descriptor when it goes out of scope.
struct FdCloser {
  int fd;
  ~FdCloser() { ::close(fd); }
};

// Reads fd to its end in pieces of buf[0, size), calling fn(data, n) for each (EINTR retried);
// a read error is an Error naming `path`.
template <class Fn>
void read_pieces(int fd, const std::string& path, char* buf, size_t size, Fn&& fn) {
  for (;;) {
    const ssize_t r = ::read(fd, buf, size);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const int err = errno;
      throw Error("cannot read '" + path + "': " + errno_text(err) + "; check the disk and path");
    }
    if (r == 0) return;
    fn(buf, static_cast<size_t>(r));
  }
}

}  // namespace

int open_regular_file(const std::string& path, int flags, const char* verb) {
  // O_NONBLOCK: opening a FIFO must not wait for its other end (it is refused below); regular
  // files ignore it. Then the descriptor is made blocking again for the caller's reads/writes.
  int fd = ::open(path.c_str(), flags | O_CLOEXEC | O_NONBLOCK, 0666);
  if (fd < 0) {
    int err = errno;
    if (err == ELOOP && (flags & O_NOFOLLOW)) {
      throw Error(std::string("cannot ") + verb + " '" + path +
                  "': it is a symbolic link, which the engine does not follow for a file it "
                  "writes itself (it would change the link's target); remove the link");
    }
    const char* fix = err == ENOENT                   ? "; check the path"
                      : err == EACCES || err == EPERM ? "; check the file's permissions"
                      : err == EROFS                  ? "; the file system is read-only"
                      : err == EMFILE || err == ENFILE
                          ? "; too many open files: raise the limit (ulimit -n)"
                          : "";
    throw Error(std::string("cannot ") + verb + " '" + path + "': " + errno_text(err) + fix);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const std::string kind = kind_of(st.st_mode);
    ::close(fd);
    throw Error(std::string("cannot ") + verb + " '" + path + "': it is " + kind +
                ", not a regular file; give the path of a file");
  }
  // /proc and /sys files pass as empty regular files, but reading one may block (/proc/kmsg) or
  // never end (/proc/self/pagemap).
  struct statfs fsst {};
  if (::fstatfs(fd, &fsst) == 0 && is_kernel_interface(fsst.f_type)) {
    ::close(fd);
    throw Error(std::string("cannot ") + verb + " '" + path +
                "': it is a file of /proc or /sys (a kernel interface, not a file on disk); "
                "give the path of a file");
  }
  (void)::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

bool writer_pid_gone(const std::string& name, size_t at) {
  if (at >= name.size()) return false;
  const char* begin = name.c_str() + at;
  char* end = nullptr;
  const long long pid = std::strtoll(begin, &end, 10);
  if (end == begin || *end != '.' || pid <= 0 || pid > INT32_MAX) return false;
  return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

std::string make_temp_dir(const std::string& prefix, const std::string& where) {
  std::string name = prefix + "XXXXXX";
  if (::mkdtemp(name.data()) == nullptr) {
    const int err = errno;
    throw Error("cannot create a temporary directory '" + name + "' " + where + ": " +
                errno_text(err) + "; check that the directory is writable");
  }
  return name;
}

std::string errno_text(int err) {
  char buf[256];
  // GNU strerror_r may return a static string instead of filling buf; handle both variants.
#if defined(__GLIBC__) && defined(_GNU_SOURCE)
  const char* s = strerror_r(err, buf, sizeof(buf));
  return std::string(s);
#else
  if (strerror_r(err, buf, sizeof(buf)) != 0) return "errno " + std::to_string(err);
  return std::string(buf);
#endif
}

std::string file_name_of(const std::string& path) {
  size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::string join_path(const std::string& dir, const std::string& rel) {
  if (dir.empty()) return rel;
  if (!rel.empty() && rel.front() == '/') return rel;
  if (dir.back() == '/') return dir + rel;
  return dir + "/" + rel;
}

std::string absolute_path(const std::string& path) {
  return path.empty() ? path : std::filesystem::absolute(path).lexically_normal().string();
}

std::string read_file(const std::string& path) {
  const FdCloser fd{open_regular_file(path, O_RDONLY, "read")};
  struct stat st {};
  (void)::fstat(fd.fd, &st);
  std::string out;
  // (a file that grows while it is read is read to its end)
  if (st.st_size > 0) out.reserve(static_cast<size_t>(st.st_size));
  char buf[1 << 16];
  read_pieces(fd.fd, path, buf, sizeof buf, [&](const char* p, size_t n) { out.append(p, n); });
  return out;
}

std::string read_file_prefix(const std::string& path, size_t max_bytes) {
  const FdCloser fd{open_regular_file(path, O_RDONLY, "read")};
  // Grown as it is read, up to the file's size: the whole max_bytes allocated and zero-filled up
  // front cost 64 MiB of memory for each small file read (`latest`, a train_config.json), and
  // raised a run's reported peak memory about 3x (twenty-third hostile pass).
  std::string out;
  struct stat st {};
  if (::fstat(fd.fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) {
    out.reserve(std::min(static_cast<size_t>(st.st_size), max_bytes));
  }
  char buf[1 << 16];
  while (out.size() < max_bytes) {
    const ssize_t r = ::read(fd.fd, buf, std::min(sizeof buf, max_bytes - out.size()));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const int err = errno;
      throw Error("cannot read '" + path + "': " + errno_text(err) + "; check the disk and path");
    }
    if (r == 0) break;
    out.append(buf, static_cast<size_t>(r));
  }
  return out;
}

void copy_file_atomic(const std::string& from, const std::string& to) {
  const FdCloser fd{open_regular_file(from, O_RDONLY, "read")};
  AtomicFileWriter out(to);
  std::vector<char> buf(size_t{1} << 20);
  read_pieces(fd.fd, from, buf.data(), buf.size(),
              [&](const char* p, size_t n) { out.write(p, n); });
  out.commit();
}

void for_each_piece(const std::string& path, const std::function<void(const char*, size_t)>& fn) {
  const FdCloser fd{open_regular_file(path, O_RDONLY, "read")};
  std::vector<char> buf(size_t{1} << 20);
  read_pieces(fd.fd, path, buf.data(), buf.size(), fn);
}

void for_each_line(const std::string& path, size_t max_line,
                   const std::function<void(std::string_view, int64_t, bool)>& fn) {
  const FdCloser fd{open_regular_file(path, O_RDONLY, "read")};
  std::string line;
  bool cut = false;
  int64_t number = 0;
  std::vector<char> buf(size_t{1} << 16);
  read_pieces(fd.fd, path, buf.data(), buf.size(), [&](const char* p, size_t r) {
    const char* end = p + r;
    while (p < end) {
      const char* nl = static_cast<const char*>(std::memchr(p, '\n', static_cast<size_t>(end - p)));
      const char* stop = nl ? nl : end;
      const size_t room = max_line - std::min(max_line, line.size());
      const size_t take = std::min(room, static_cast<size_t>(stop - p));
      line.append(p, take);
      cut = cut || take < static_cast<size_t>(stop - p);
      if (!nl) break;
      fn(line, ++number, cut);
      line.clear();
      cut = false;
      p = nl + 1;
    }
  });
  if (!line.empty() || cut) fn(line, ++number, cut);
}

std::string read_small_file(const std::string& path, size_t max_bytes, const std::string& what) {
  std::string text = read_file_prefix(path, max_bytes + 1);
  check(text.size() <= max_bytes, "'" + path + "' is larger than " + what + " ever is (at most " +
                                      std::to_string(max_bytes) +
                                      " bytes): it is not one; move it away or restore it");
  return text;
}

// ---------------------------------------------------------------------------------------------
// AtomicFileWriter

AtomicFileWriter::AtomicFileWriter(std::string path) : path_(std::move(path)) {
  check(!path_.empty(), "cannot write a file with an empty path; give an output path");
  // The rename would replace whatever the path names: a device or FIFO given as an output path
  // (as root, even /dev/null) must not become a regular file.
  struct stat old {};
  if (::stat(path_.c_str(), &old) == 0 && !S_ISREG(old.st_mode)) {
    throw Error("cannot write '" + path_ + "': it is " + kind_of(old.st_mode) +
                ", not a regular file, and writing would replace it; give another output path");
  }
  // O_EXCL | O_NOFOLLOW: a file or link someone placed at the temp name is never written
  // through (a link there would redirect the write to its target); the next name is tried.
  for (int attempt = 0;; ++attempt) {
    tmp_ = temp_name_for(path_);
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd_ >= 0 || errno != EEXIST || attempt >= 1000) break;
  }
  if (fd_ < 0) {
    int err = errno;
    throw Error("cannot write '" + path_ + "': creating temp file '" + tmp_ +
                "' failed: " + errno_text(err) + "; " + write_fix_hint(err));
  }
  // Keep the permissions of the file being replaced (e.g. a read-only-for-group checkpoint).
  struct stat st {};
  if (::stat(path_.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
    (void)::fchmod(fd_, st.st_mode & 07777);
  }
}

AtomicFileWriter::~AtomicFileWriter() {
  if (!committed_) discard();
}

void AtomicFileWriter::discard() noexcept {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
}

void AtomicFileWriter::fail(const std::string& what, int err) {
  discard();
  committed_ = true;  // nothing left to clean up; later calls must not touch the (gone) temp file
  throw Error("cannot write '" + path_ + "': " + what + ": " + errno_text(err) + "; " +
              write_fix_hint(err) + " (the previous '" + file_name_of(path_) +
              "', if any, is unchanged)");
}

void AtomicFileWriter::write_raw(const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    // Linux caps a single write at ~2 GiB; chunk explicitly so large tensors are fine.
    size_t chunk = n < (size_t{1} << 30) ? n : (size_t{1} << 30);
    ssize_t w = ::write(fd_, c, chunk);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("write failed after " + std::to_string(written_) + " bytes", errno);
    }
    if (w == 0) fail("write made no progress after " + std::to_string(written_) + " bytes", EIO);
    c += w;
    n -= static_cast<size_t>(w);
    written_ += static_cast<uint64_t>(w);
  }
}

void AtomicFileWriter::flush_buffer() {
  if (buf_.empty()) return;
  std::string pending;
  pending.swap(buf_);
  write_raw(pending.data(), pending.size());
}

void AtomicFileWriter::write(const void* p, size_t n) {
  check(fd_ >= 0 && !committed_,
        "internal: write to '" + path_ + "' after commit or after a failed write");
  constexpr size_t kBuf = size_t{1} << 20;
  if (n == 0) return;
  if (buf_.size() + n <= kBuf) {
    if (buf_.capacity() < kBuf) buf_.reserve(kBuf);
    buf_.append(static_cast<const char*>(p), n);
    return;
  }
  flush_buffer();
  if (n < kBuf) {
    buf_.append(static_cast<const char*>(p), n);
  } else {
    write_raw(p, n);
  }
}

void AtomicFileWriter::commit() {
  check(fd_ >= 0 && !committed_,
        "internal: commit of '" + path_ + "' twice or after a failed write");
  flush_buffer();
  // fsync before rename: otherwise a crash can leave the new name pointing at an empty inode.
  if (::fsync(fd_) != 0) fail("fsync failed", errno);
  int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    int err = errno;
    fail("close failed", err);
  }
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    int err = errno;
    fail("renaming '" + tmp_ + "' over it failed", err);
  }
  committed_ = true;
  // fsync the directory so the rename itself survives a crash. Some filesystems refuse fsync on
  // directories (EINVAL); the data is in place then, so only real I/O errors are reported.
  int dfd = ::open(dir_of(path_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    int rc = ::fsync(dfd);
    int err = errno;
    ::close(dfd);
    if (rc != 0 && err == EIO) {
      throw Error("wrote '" + path_ + "' but syncing its directory failed: " + errno_text(err) +
                  "; the disk may be failing, check it before trusting the file");
    }
  }
}

void write_file_atomic(const std::string& path, std::string_view data) {
  AtomicFileWriter w(path);
  w.write(data.data(), data.size());
  w.commit();
}

// ---------------------------------------------------------------------------------------------
// MappedFile

namespace {

// The live mappings, for mapped_file_at in a signal handler: fixed slots, no allocation, no lock.
struct MapSlot {
  std::atomic<int> state{0};  // 0 free, 1 being written, 2 published
  const uint8_t* begin = nullptr;
  size_t size = 0;
  char path[256] = {};
};
MapSlot g_maps[64];

void publish_mapping(const uint8_t* begin, size_t size, const std::string& path) {
  for (MapSlot& s : g_maps) {
    int free = 0;
    if (!s.state.compare_exchange_strong(free, 1)) continue;
    s.begin = begin;
    s.size = size;
    const size_t n = std::min(path.size(), sizeof s.path - 1);
    std::memcpy(s.path, path.data(), n);
    s.path[n] = '\0';
    s.state.store(2, std::memory_order_release);
    return;
  }  // (all slots taken: that mapping's fault is reported without its name)
}

void retract_mapping(const uint8_t* begin) {
  for (MapSlot& s : g_maps) {
    if (s.state.load(std::memory_order_acquire) == 2 && s.begin == begin) {
      s.state.store(0, std::memory_order_release);
      return;
    }
  }
}

}  // namespace

const char* mapped_file_at(const void* addr) {
  const auto* a = static_cast<const uint8_t*>(addr);
  for (MapSlot& s : g_maps) {
    if (s.state.load(std::memory_order_acquire) == 2 && a >= s.begin && a < s.begin + s.size) {
      return s.path;
    }
  }
  return nullptr;
}

MappedFile MappedFile::open(const std::string& path) {
  const int fd = open_regular_file(path, O_RDONLY, "open");
  struct stat st {};
  (void)::fstat(fd, &st);
  MappedFile m;
  m.path_ = path;
  m.size_ = static_cast<size_t>(st.st_size);
  if (m.size_ > 0) {
    void* p = ::mmap(nullptr, m.size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      throw Error("cannot map '" + path + "' (" + std::to_string(m.size_) +
                  " bytes): " + errno_text(err) + "; check available memory / address space");
    }
    m.data_ = static_cast<const uint8_t*>(p);
    publish_mapping(m.data_, m.size_, path);
  }
  // The mapping keeps the inode alive; the descriptor is no longer needed.
  ::close(fd);
  return m;
}

MappedFile::~MappedFile() { release(); }

void MappedFile::release() noexcept {
  if (data_ != nullptr) {
    retract_mapping(data_);
    ::munmap(const_cast<uint8_t*>(data_), size_);
  }
  data_ = nullptr;
  size_ = 0;
}

MappedFile::MappedFile(MappedFile&& o) noexcept
    : path_(std::move(o.path_)), data_(o.data_), size_(o.size_) {
  o.data_ = nullptr;
  o.size_ = 0;
}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    release();
    path_ = std::move(o.path_);
    data_ = o.data_;
    size_ = o.size_;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

}  // namespace attnres

// ---------------------------------------------------------------------------------------------
// AppendFile

namespace attnres {

AppendFile::~AppendFile() { close(); }

void AppendFile::close() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

int64_t AppendFile::open(const std::string& path) {
  close();
  path_ = path;
  fd_ = open_regular_file(path, O_RDWR | O_CREAT | O_NOFOLLOW, "append to");
  struct stat st {};
  (void)::fstat(fd_, &st);
  if (st.st_nlink > 1) {
    // A hard link (a backup made with cp -al or rsync --link-dest): appending would add this
    // run's lines to the other name too. Append to a private copy, put in place by rename.
    close();
    copy_file_atomic(path, path);
    fd_ = open_regular_file(path, O_RDWR | O_NOFOLLOW, "append to");
    (void)::fstat(fd_, &st);
  }
  // Drop a torn last line: find the last newline in the file's tail and cut after it.
  int64_t size = st.st_size, keep = size;
  char buf[4096];
  while (keep > 0) {
    const int64_t from = std::max<int64_t>(0, keep - static_cast<int64_t>(sizeof buf));
    const ssize_t r = ::pread(fd_, buf, static_cast<size_t>(keep - from), from);
    if (r <= 0) break;
    int64_t i = r - 1;
    while (i >= 0 && buf[i] != '\n') i--;
    if (i >= 0) {
      keep = from + i + 1;
      break;
    }
    keep = from;
  }
  if (keep < size && ::ftruncate(fd_, keep) != 0) {
    const int err = errno;
    close();
    throw Error("cannot repair '" + path + "' (a torn last line): " + errno_text(err) + "; " +
                write_fix_hint(err));
  }
  if (::lseek(fd_, 0, SEEK_END) < 0) {
    const int err = errno;
    close();
    throw Error("cannot append to '" + path + "': " + errno_text(err));
  }
  return size - keep;
}

void AppendFile::append(std::string_view lines) {
  check(fd_ >= 0, "internal: AppendFile::append before open");
  // A hard link made since the file was opened (a backup taken with cp -al while the run
  // trains) would take this run's later lines too (22nd hostile pass): the file is copied
  // first, as open() does, while `path_` still names it.
  struct stat st {
  }, at{};
  if (::fstat(fd_, &st) == 0 && st.st_nlink > 1 && ::lstat(path_.c_str(), &at) == 0 &&
      at.st_dev == st.st_dev && at.st_ino == st.st_ino) {
    open(path_);
  }
  size_t done = 0;
  while (done < lines.size()) {
    const ssize_t w = ::write(fd_, lines.data() + done, lines.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const int err = w < 0 ? errno : ENOSPC;
      // Cut what this append wrote, so the file ends with a complete line again.
      const off_t end = ::lseek(fd_, 0, SEEK_CUR);
      if (end >= 0 && ::ftruncate(fd_, end - static_cast<off_t>(done)) == 0) {
        (void)::lseek(fd_, end - static_cast<off_t>(done), SEEK_SET);
      }
      throw Error("cannot write '" + path_ + "': write failed after " + std::to_string(done) +
                  " of " + std::to_string(lines.size()) + " bytes: " + errno_text(err) + "; " +
                  write_fix_hint(err));
    }
    done += static_cast<size_t>(w);
  }
}

}  // namespace attnres
