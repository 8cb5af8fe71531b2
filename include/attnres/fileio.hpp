// attnres/fileio.hpp — whole-file reads, crash-safe writes and read-only memory maps.
//
// Every file the engine produces (checkpoints, tokenizer models, token caches) goes through the
// atomic writers here, so a crash, a full disk or a kill never leaves a half-written file under
// the final name: readers either see the old file or the complete new one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

namespace attnres {

// Every reader opens files through open_regular_file: a FIFO, a device (e.g. a symlink to
// /dev/zero), a socket or a directory is refused with an Error naming the path, before any read
// (opening a FIFO would block until a writer came; reading /dev/zero would never end).

// Opens `path` with `flags` (O_RDONLY, or O_WRONLY | O_APPEND | O_CREAT, ...) and returns the
// descriptor, or throws Error ("cannot <verb> '<path>': ...") if it cannot or the path is not a
// regular file.
int open_regular_file(const std::string& path, int flags, const char* verb);

// Returns the whole content of `path`; throws Error naming the path if it is missing, unreadable
// or not a regular file.
std::string read_file(const std::string& path);
// At most the first max_bytes of `path` (the same checks as read_file).
std::string read_file_prefix(const std::string& path, size_t max_bytes);
// The whole of a file that is small by nature (`latest`, a config, a key): Error naming the path
// and `what` it should be when it holds more than max_bytes, read no further than that.
std::string read_small_file(const std::string& path, size_t max_bytes, const std::string& what);

// Copies `from` to `to` in pieces, with the guarantees of write_file_atomic (from == to makes a
// private copy of a hard-linked file).
void copy_file_atomic(const std::string& from, const std::string& to);

// Calls fn(data, n) on the content of `path` piece by piece, to its end: memory stays bounded
// however large the file. Same open checks as read_file.
void for_each_piece(const std::string& path, const std::function<void(const char*, size_t)>& fn);

// Calls fn(line, number) for each line of `path` (1-based numbers; no '\n'), reading it in
// pieces: memory stays bounded however large the file. A line longer than max_line is passed
// as its first max_line bytes with `cut` true (its rest skipped), so no line is held whole.
// A final line without its newline is passed too. Same open checks as read_file.
void for_each_line(const std::string& path, size_t max_line,
                   const std::function<void(std::string_view line, int64_t number, bool cut)>& fn);

// The longest metrics.jsonl line read (a diagnostics line of a deep model is well under a MiB).
constexpr size_t kMaxMetricsLine = size_t{16} << 20;

// The largest tokenizer.model read (SentencePiece models of 256k pieces are a few MiB).
constexpr size_t kMaxSentencePieceBytes = size_t{256} << 20;

// `path` made absolute against the working directory and normalised ("" stays ""): how a run
// records its corpus, so that a resume from another directory reads the same one.
std::string absolute_path(const std::string& path);

// Appends lines to a log file (metrics.jsonl): each append is one write of whole lines, checked;
// a failed or short write is an Error naming the file, the OS error and the fix. Opening drops a
// torn last line (a line without its newline, left by a kill or a full disk mid-write), so the
// file always ends with a complete line.
class AppendFile {
 public:
  AppendFile() = default;
  ~AppendFile();
  AppendFile(const AppendFile&) = delete;
  AppendFile& operator=(const AppendFile&) = delete;
  // Opens (creating) `path`; returns the bytes of a torn last line it dropped (0: none).
  int64_t open(const std::string& path);
  void append(std::string_view lines);
  void close() noexcept;

 private:
  std::string path_;
  int fd_ = -1;
};

// Replaces `path` with `data` atomically (temp file in the same directory, fsync, rename, fsync of
// the directory). On any failure the temp file is removed, the old `path` is untouched and Error
// names `path` and the OS error.
void write_file_atomic(const std::string& path, std::string_view data);

// Streams a large file to `path` with the guarantees of write_file_atomic. Nothing is visible under
// `path` until commit() succeeds; destroying an uncommitted writer removes the temp file.
class AtomicFileWriter {
 public:
  // Creates a new temp file "<path>.tmp.<pid>.<n>" next to `path` (never an existing file or
  // link: the next n is tried); throws Error if it cannot.
  explicit AtomicFileWriter(std::string path);
  // Removes the temp file unless commit() succeeded. Never throws.
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  // Appends n bytes; throws Error (and discards the temp file) on a failed or short write.
  void write(const void* p, size_t n);
  // Appends a string's bytes; same contract as write(p, n).
  void write(std::string_view s) { write(s.data(), s.size()); }
  // Flushes, fsyncs and renames the temp file over `path`; throws Error on failure.
  void commit();
  // Bytes written so far.
  uint64_t bytes_written() const { return written_; }
  // Final destination path.
  const std::string& path() const { return path_; }
  // Temp file path (exposed for tests and error messages).
  const std::string& temp_path() const { return tmp_; }

 private:
  void flush_buffer();
  void write_raw(const void* p, size_t n);
  [[noreturn]] void fail(const std::string& what, int err);
  void discard() noexcept;

  std::string path_;
  std::string tmp_;
  int fd_ = -1;
  bool committed_ = false;
  uint64_t written_ = 0;
  std::string buf_;  // coalesces small writes (headers, many small tensors) into large syscalls
};

// A read-only memory map of a whole file. Empty files map to data() == nullptr, size() == 0.
// Note: if another process truncates the file while it is mapped, reads fault (SIGBUS); the engine
// replaces its own files by rename, which never truncates the mapped inode, and the CLI's SIGBUS
// handler names the file another program cut (mapped_file_at).
class MappedFile {
 public:
  // Maps `path` read-only; throws Error naming the path if it is missing, a directory or
  // unmappable.
  static MappedFile open(const std::string& path);

  MappedFile() = default;
  ~MappedFile();
  MappedFile(MappedFile&& o) noexcept;
  MappedFile& operator=(MappedFile&& o) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  // First byte of the mapping (nullptr for an empty file).
  const uint8_t* data() const { return data_; }
  // File size in bytes at the time it was mapped.
  size_t size() const { return size_; }
  // Path the file was opened with.
  const std::string& path() const { return path_; }

 private:
  void release() noexcept;

  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// The path of the MappedFile whose mapping holds `addr`, or nullptr. Async-signal-safe (for a
// SIGBUS handler); paths longer than 255 bytes are cut.
const char* mapped_file_at(const void* addr);

// Makes a new, empty directory named `prefix` + six random characters (mkdtemp, mode 0700) and
// returns its path; a path someone placed there cannot be taken for it. `where` names the place
// in the error ("in --out 'runs/x'").
std::string make_temp_dir(const std::string& prefix, const std::string& where);

// Whether the process whose id `name` holds at `at` (decimal digits, then '.') no longer exists:
// the writer of a temporary file or directory named with its pid. False when no pid parses there
// (treated as alive).
bool writer_pid_gone(const std::string& name, size_t at);

// Returns strerror(err) as a std::string (thread-safe).
std::string errno_text(int err);

// Returns the last path component of `path` ("a/b/c.txt" -> "c.txt").
std::string file_name_of(const std::string& path);

// Joins a directory and a relative path with exactly one '/' ("" dir returns rel unchanged).
std::string join_path(const std::string& dir, const std::string& rel);

}  // namespace attnres
