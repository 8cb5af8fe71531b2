// Tests for attnres/fileio.hpp: atomic replacement, failure cleanup, and memory maps.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using namespace attnres;

namespace {

// A fresh directory under the system temp dir, removed with its contents at scope exit.
using attnres::testing::TempDir;

// Names in dir containing ".tmp." (leftover temp files).
int count_temp_files(const std::string& dir) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().filename().string().find(".tmp.") != std::string::npos) ++n;
  }
  return n;
}

}  // namespace

TEST(FileIO, ReadMissingFileNamesPath) {
  TempDir d;
  try {
    read_file(d.file("nope.txt"));
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nope.txt"), std::string::npos) << e.what();
  }
}

// A small file read under a large limit costs its own size, not the limit's: read_file_prefix
// allocated and zero-filled the whole limit (64 MiB for `latest` or a train_config.json), which
// raised --overwrite's reported peak memory about 3x (twenty-third hostile pass).
TEST(FileIO, SmallFileUnderALargeLimitCostsItsOwnSize) {
  TempDir d;
  const std::string path = d.file("latest");
  write_file_atomic(path, "step_00000002\n");
  auto peak_mib = [] {
    struct rusage ru {};
    ::getrusage(RUSAGE_SELF, &ru);
    return static_cast<double>(ru.ru_maxrss) / 1024.0;
  };
  const double before = peak_mib();
  EXPECT_EQ(read_small_file(path, size_t{1} << 30, "a latest file"), "step_00000002\n");
  EXPECT_EQ(read_file_prefix(path, size_t{1} << 30), "step_00000002\n");
  EXPECT_EQ(read_file_prefix(path, 4), "step");
  EXPECT_LT(peak_mib() - before, 64.0) << "a 1 GiB limit's buffer was touched";
}

TEST(FileIO, AtomicWriteCreatesAndReplaces) {
  TempDir d;
  const std::string p = d.file("a.bin");
  write_file_atomic(p, "first version");
  EXPECT_EQ(read_file(p), "first version");
  std::string big(3 << 20, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 131 + 7);
  write_file_atomic(p, big);
  EXPECT_EQ(read_file(p), big);
  write_file_atomic(p, "");
  EXPECT_EQ(read_file(p), "");
  EXPECT_EQ(count_temp_files(d.path), 0);
}

TEST(FileIO, StreamedWriterCommitsAndDiscards) {
  TempDir d;
  const std::string p = d.file("s.bin");
  {
    AtomicFileWriter w(p);
    for (int i = 0; i < 1000; ++i) w.write("0123456789", 10);
    std::string large(5 << 20, 'x');  // bypasses the internal buffer
    w.write(large);
    EXPECT_FALSE(fs::exists(p)) << "nothing may appear under the final name before commit";
    w.commit();
    EXPECT_EQ(w.bytes_written(), 10000u + (5u << 20));
  }
  EXPECT_EQ(fs::file_size(p), 10000u + (5u << 20));
  {
    AtomicFileWriter w(p);
    w.write("replacement that is abandoned");
    EXPECT_TRUE(fs::exists(w.temp_path()));
  }  // destroyed without commit
  EXPECT_EQ(fs::file_size(p), 10000u + (5u << 20));
  EXPECT_EQ(count_temp_files(d.path), 0);
}

TEST(FileIO, WriteIntoMissingDirectoryFailsCleanly) {
  TempDir d;
  const std::string p = d.file("no_such_dir/x.bin");
  try {
    write_file_atomic(p, "data");
    FAIL() << "expected Error";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("no_such_dir/x.bin"), std::string::npos) << msg;
    EXPECT_NE(msg.find("No such file"), std::string::npos) << msg;
  }
  EXPECT_FALSE(fs::exists(p));
}

// A write that exceeds RLIMIT_FSIZE fails with EFBIG mid-stream (like ENOSPC would). Done in a
// forked child so the limit does not affect the test process.
TEST(FileIO, FailedWriteKeepsOldFileAndRemovesTemp) {
  TempDir d;
  const std::string p = d.file("ckpt.bin");
  const std::string old_content = "old checkpoint content";
  write_file_atomic(p, old_content);

  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl {};
    rl.rlim_cur = rl.rlim_max = 64 * 1024;
    if (::setrlimit(RLIMIT_FSIZE, &rl) != 0) ::_exit(10);
    int code = 11;
    try {
      write_file_atomic(p, std::string(1 << 20, 'n'));  // 1 MiB > 64 KiB limit
      code = 12;                                        // should not succeed
    } catch (const Error& e) {
      std::string msg = e.what();
      code = (msg.find("ckpt.bin") != std::string::npos &&
              msg.find("File too large") != std::string::npos)
                 ? 0
                 : 13;
    }
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "child exit code (12: write succeeded, 13: bad message)";
  EXPECT_EQ(read_file(p), old_content);
  EXPECT_EQ(count_temp_files(d.path), 0);
}

TEST(FileIO, StreamedWriterFailureMidStream) {
  TempDir d;
  const std::string p = d.file("big.bin");
  write_file_atomic(p, "keep me");
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl {};
    rl.rlim_cur = rl.rlim_max = 3 << 20;
    if (::setrlimit(RLIMIT_FSIZE, &rl) != 0) ::_exit(10);
    try {
      AtomicFileWriter w(p);
      std::string chunk(1 << 20, 'z');
      for (int i = 0; i < 8; ++i) w.write(chunk);
      w.commit();
      ::_exit(12);
    } catch (const Error&) {
      ::_exit(0);
    }
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(read_file(p), "keep me");
  EXPECT_EQ(count_temp_files(d.path), 0);
}

TEST(FileIO, PreservesPermissionsOfReplacedFile) {
  TempDir d;
  const std::string p = d.file("perm.txt");
  write_file_atomic(p, "a");
  fs::permissions(p, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  write_file_atomic(p, "b");
  EXPECT_EQ(fs::status(p).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
}

TEST(FileIO, LinksAtTheTempNameAreNeverWrittenThrough) {
  // Someone who can write the directory plants symbolic links (and a plain file) at the temp
  // names the writer will use ("<path>.tmp.<pid>.<n>"); the write must go to a fresh file of its
  // own and leave the links' target untouched.
  TempDir d;
  const std::string p = d.file("out.bin");
  const std::string victim = d.file("victim.txt");
  write_file_atomic(victim, "precious");
  const std::string stem = p + ".tmp." + std::to_string(::getpid()) + ".";
  for (int k = 0; k < 400; ++k) {
    if (k == 7) {
      write_file_atomic(stem + std::to_string(k), "someone else's file");
    } else {
      fs::create_symlink(victim, stem + std::to_string(k));
    }
  }
  for (int i = 0; i < 3; ++i) write_file_atomic(p, "result " + std::to_string(i));
  EXPECT_EQ(read_file(p), "result 2");
  EXPECT_EQ(read_file(victim), "precious");
  EXPECT_EQ(read_file(stem + "7"), "someone else's file");
  EXPECT_TRUE(fs::is_symlink(stem + "0"));
}

TEST(FileIO, MappedFileReadsAndMoves) {
  TempDir d;
  const std::string p = d.file("m.bin");
  write_file_atomic(p, "hello mmap");
  MappedFile m = MappedFile::open(p);
  ASSERT_EQ(m.size(), 10u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(m.data()), m.size()), "hello mmap");
  EXPECT_EQ(m.path(), p);
  const uint8_t* before = m.data();
  MappedFile m2 = std::move(m);
  EXPECT_EQ(m2.data(), before);
  EXPECT_EQ(m.data(), nullptr);
  MappedFile m3;
  m3 = std::move(m2);
  EXPECT_EQ(m3.data(), before);
  EXPECT_EQ(m3.size(), 10u);
  // The SIGBUS handler's lookup: the mapping's bytes name the file while it is mapped.
  EXPECT_STREQ(mapped_file_at(before + 3), p.c_str());
  EXPECT_EQ(mapped_file_at(before + 4096), nullptr);
  m3 = MappedFile();
  EXPECT_EQ(mapped_file_at(before + 3), nullptr);

  const std::string e = d.file("empty.bin");
  write_file_atomic(e, "");
  MappedFile me = MappedFile::open(e);
  EXPECT_EQ(me.size(), 0u);
}

TEST(FileIO, MappedFileErrors) {
  TempDir d;
  EXPECT_THROW(MappedFile::open(d.file("missing.bin")), Error);
  EXPECT_THROW(MappedFile::open(d.path), Error);  // a directory
  EXPECT_THROW(read_file(d.path), Error);
}

TEST(FileIO, PathHelpers) {
  EXPECT_EQ(file_name_of("a/b/c.txt"), "c.txt");
  EXPECT_EQ(file_name_of("c.txt"), "c.txt");
  EXPECT_EQ(join_path("a", "b"), "a/b");
  EXPECT_EQ(join_path("a/", "b"), "a/b");
  EXPECT_EQ(join_path("", "b"), "b");
  EXPECT_EQ(join_path("a", "/abs"), "/abs");
}

// Issue 19, class F: a FIFO, a device or a directory is refused by every reader before it reads
// (a FIFO would block the open, /dev/zero would never end), and no writer replaces one.
TEST(FileIO, SpecialFilesAreRefusedAndNeverReplaced) {
  TempDir d;
  const std::string fifo = d.file("fifo"), zero = d.file("zero");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::filesystem::create_symlink("/dev/zero", zero);
  auto error_of = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of([&] { read_file(fifo); }).find("a FIFO (named pipe), not a regular file"),
            std::string::npos);
  EXPECT_NE(error_of([&] { read_file(zero); }).find("a character device"), std::string::npos);
  EXPECT_NE(error_of([&] { read_file(d.path); }).find("a directory"), std::string::npos);
  EXPECT_NE(error_of([&] { MappedFile::open(fifo); }).find("FIFO"), std::string::npos);
  EXPECT_NE(error_of([&] { write_file_atomic(fifo, "x"); }).find("would replace it"),
            std::string::npos);
  EXPECT_TRUE(std::filesystem::is_fifo(fifo));  // still the FIFO
  AppendFile log;
  EXPECT_NE(error_of([&] { log.open(fifo); }).find("FIFO"), std::string::npos);
}

// Class E: a log's torn last line (a kill or a full disk mid-write) is dropped when it is opened
// again, and a failed append (here the file size limit) is an error that leaves whole lines only.
TEST(FileIO, AppendFileKeepsWholeLines) {
  TempDir d;
  const std::string p = d.file("metrics.jsonl");
  write_file_atomic(p, "{\"a\":1}\n{\"b\":");
  {
    AppendFile f;
    EXPECT_EQ(f.open(p), 5);  // the torn {"b":
    f.append("{\"c\":3}\n");
  }
  EXPECT_EQ(read_file(p), "{\"a\":1}\n{\"c\":3}\n");
  // Tenth hostile pass: a hard-linked backup of the run (cp -al) gained the live run's lines.
  const std::string backup = d.file("backup.jsonl");
  ASSERT_EQ(::link(p.c_str(), backup.c_str()), 0);
  {
    AppendFile f;
    f.open(p);
    f.append("{\"d\":4}\n");
  }
  EXPECT_EQ(read_file(backup), "{\"a\":1}\n{\"c\":3}\n");
  EXPECT_EQ(read_file(p), "{\"a\":1}\n{\"c\":3}\n{\"d\":4}\n");
  // Twenty-second: a link made while the file is open (a backup of a live run).
  {
    AppendFile f;
    f.open(p);
    f.append("{\"e\":5}\n");
    const std::string live_backup = d.file("live_backup.jsonl");
    ASSERT_EQ(::link(p.c_str(), live_backup.c_str()), 0);
    f.append("{\"f\":6}\n");
    EXPECT_EQ(read_file(live_backup), "{\"a\":1}\n{\"c\":3}\n{\"d\":4}\n{\"e\":5}\n");
    EXPECT_EQ(read_file(p), "{\"a\":1}\n{\"c\":3}\n{\"d\":4}\n{\"e\":5}\n{\"f\":6}\n");
  }
  write_file_atomic(p, "{\"a\":1}\n{\"c\":3}\n");
  struct rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  struct sigaction ign {
  }, prev{};
  ign.sa_handler = SIG_IGN;
  ASSERT_EQ(::sigaction(SIGXFSZ, &ign, &prev), 0);
  struct rlimit lim = old;
  lim.rlim_cur = 40;  // the next line crosses it
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
  std::string err;
  {
    AppendFile f;
    f.open(p);
    try {
      f.append("{\"long\":\"" + std::string(64, 'x') + "\"}\n");
    } catch (const Error& e) {
      err = e.what();
    }
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::sigaction(SIGXFSZ, &prev, nullptr);
  EXPECT_NE(err.find("metrics.jsonl"), std::string::npos) << err;
  EXPECT_NE(err.find("File too large"), std::string::npos) << err;
  EXPECT_EQ(read_file(p), "{\"a\":1}\n{\"c\":3}\n");
}

// Eighteenth hostile pass: a 20 GiB metrics.jsonl was read whole (twice) on --resume. Lines
// are streamed, and a line longer than the bound is cut, never held whole.
TEST(FileIO, ForEachLineStreamsAndCutsLongLines) {
  TempDir d;
  const std::string p = d.file("lines.txt");
  write_file_atomic(p, "a\n\n" + std::string(100, 'x') + "\nlast");
  std::vector<std::tuple<std::string, int64_t, bool>> got;
  for_each_line(p, 10, [&](std::string_view line, int64_t n, bool cut) {
    got.emplace_back(std::string(line), n, cut);
  });
  const std::vector<std::tuple<std::string, int64_t, bool>> want = {
      {"a", 1, false}, {"", 2, false}, {std::string(10, 'x'), 3, true}, {"last", 4, false}};
  EXPECT_EQ(got, want);
  // A sparse file of 64 MiB without a newline: one cut line of the bound's length.
  ASSERT_EQ(::truncate(p.c_str(), 0), 0);
  ASSERT_EQ(::truncate(p.c_str(), int64_t{64} << 20), 0);
  int64_t lines = 0;
  size_t longest = 0;
  for_each_line(p, 4096, [&](std::string_view line, int64_t, bool cut) {
    lines++;
    longest = std::max(longest, line.size());
    EXPECT_TRUE(cut);
  });
  EXPECT_EQ(lines, 1);
  EXPECT_EQ(longest, 4096u);
  EXPECT_THROW(for_each_line(d.file("missing"), 10, [](std::string_view, int64_t, bool) {}), Error);
}
