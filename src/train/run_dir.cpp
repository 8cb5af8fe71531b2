#include "train/run_dir.hpp"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <new>
#include <nlohmann/json.hpp>
#include <vector>

#include "attnres/checkpoint.hpp"
#include "attnres/data.hpp"
#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/safetensors.hpp"

namespace fs = std::filesystem;

namespace attnres {

namespace {

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step_%08lld", static_cast<long long>(step));
  return buf;
}

// "step_<digits>", or "step_<digits>.tmp" (a save that was interrupted).
bool is_step_name(const std::string& n) {
  const std::string digits = n.size() > 4 && n.compare(n.size() - 4, 4, ".tmp") == 0
                                 ? n.substr(5, n.size() - 9)
                                 : n.substr(std::min<size_t>(5, n.size()));
  return n.rfind("step_", 0) == 0 && !digits.empty() &&
         digits.find_first_not_of("0123456789") == std::string::npos;
}

// Whether `n` is the temp file of a write of one of `files` (fileio's "<name>.tmp.<pid>.<n>").
bool is_temp_of(const std::string& n, std::initializer_list<const char*> files) {
  for (const char* f : files) {
    const std::string head = std::string(f) + ".tmp.";
    if (n.rfind(head, 0) != 0) continue;
    const std::string rest = n.substr(head.size());
    const size_t dot = rest.find('.');
    if (dot != std::string::npos && dot > 0 && dot + 1 < rest.size() &&
        rest.find_first_not_of("0123456789.") == std::string::npos &&
        rest.find('.', dot + 1) == std::string::npos) {
      return true;
    }
  }
  return false;
}

// Whether `p` is a checkpoint RunDir::save wrote: a step directory (not a link) holding only the
// files a save writes (and the temp files of one that was interrupted). Anything else under
// checkpoints/ is the user's, and --overwrite must not delete it.
bool is_saved_checkpoint(const fs::path& p) {
  if (!is_step_name(p.filename().string()) || !fs::is_directory(fs::symlink_status(p))) {
    return false;
  }
  for (const auto& e : fs::directory_iterator(p)) {
    const std::string n = e.path().filename().string();
    const bool known = n == "model.safetensors" || n == "optimizer.safetensors" ||
                       n == "tokenizer.model" || n == kLogRecordFile ||
                       is_temp_of(n, {"model.safetensors", "optimizer.safetensors",
                                      "tokenizer.model", kLogRecordFile});
    if (!known || !fs::is_regular_file(fs::symlink_status(e.path()))) return false;
    // (another tool's step_N/model.safetensors, same layout: fourteenth hostile pass)
    if (n == "model.safetensors" && !has_attnres_model_header(e.path().string())) return false;
  }
  return true;
}

// The step number of a checkpoint directory's name (step_<digits>, or step_<digits>.tmp), or -1.
int64_t step_of_name(const std::string& n) {
  if (!is_step_name(n)) return -1;
  const std::string digits =
      n.substr(5, n.find('.') == std::string::npos ? std::string::npos : n.find('.') - 5);
  return digits.size() > 18 ? INT64_MAX : std::stoll(digits);
}

// A save replaces `p` (its step's directory, or the temp directory of an interrupted save) only
// when it is absent or a checkpoint a save wrote; anything else is the user's.
void check_replaceable(const fs::path& p, int64_t step, const std::string& out_dir) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(p, ec))) return;
  try {
    if (is_saved_checkpoint(p)) return;
  } catch (const fs::filesystem_error&) {  // (unreadable: not known to be ours)
  }
  throw Error("'" + p.string() + "' is in the way of the checkpoint of step " +
              std::to_string(step) +
              ": it is not a checkpoint this run saved (a file, a link, or a directory holding "
              "files a save does not write), and it is left alone; move it away and continue "
              "with `attnres train --resume --out " +
              shell_word(out_dir) + "`");
}

// Syncs a directory's entries. Some file systems refuse fsync on directories (EINVAL): fine;
// an I/O error is an Error (it was ignored, and a checkpoint the disk may not hold was
// published; twenty-third hostile pass).
void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  check(rc == 0 || err != EIO, "syncing the directory '" + dir + "' failed: " + errno_text(err) +
                                   "; the disk may be failing, check it");
}

}  // namespace

RunDir::RunDir(std::string out_dir, int64_t keep, std::string tokenizer_ref,
               std::string tokenizer_path, std::string tokenizer_data, std::string config_hash,
               std::string tokenizer_hash, std::string runtime)
    : out_dir_(std::move(out_dir)),
      keep_(keep),
      tokenizer_ref_(std::move(tokenizer_ref)),
      tokenizer_path_(std::move(tokenizer_path)),
      tokenizer_data_(std::move(tokenizer_data)),
      config_hash_(std::move(config_hash)),
      tokenizer_hash_(std::move(tokenizer_hash)),
      runtime_(std::move(runtime)) {}

void remove_abandoned_staging(const std::string& out_dir) {
  const std::string prefix = ".overwrite.tmp.";
  std::error_code ec;
  // The temporary files a write killed at the run's top level left (29th hostile pass: a whole
  // model.safetensors.tmp.PID.N per SIGKILL, never removed), of the run's own files only.
  for (const auto& e : fs::directory_iterator(out_dir, ec)) {
    const std::string n = e.path().filename().string();
    if (is_temp_of(n, {"model.safetensors", "train_config.json", "latest", "tokens.bin",
                       "tokenizer.model", "tokenizer.model.trainkey"}) &&
        fs::is_regular_file(fs::symlink_status(e.path(), ec)) &&
        writer_pid_gone(n, n.find(".tmp.") + 5)) {
      fs::remove(e.path(), ec);
    }
  }
  for (const auto& e : fs::directory_iterator(out_dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.size() != prefix.size() + 6 || n.rfind(prefix, 0) != 0 ||
        !fs::is_directory(fs::symlink_status(e.path(), ec))) {
      continue;
    }
    bool only_data = true;
    for (const auto& f : fs::directory_iterator(e.path(), ec)) {
      const std::string m = f.path().filename().string();
      const auto names = {"tokenizer.model", "tokenizer.model.trainkey", "tokens.bin"};
      only_data = only_data && fs::is_regular_file(fs::symlink_status(f.path(), ec)) &&
                  (std::find(names.begin(), names.end(), m) != names.end() || is_temp_of(m, names));
    }
    if (only_data && !ec) fs::remove_all(e.path(), ec);
  }
}

std::string RunDir::ckpt_root() const { return (fs::path(out_dir_) / "checkpoints").string(); }

void RunDir::save(const Model& model, AdamW& opt, int64_t step, const Metadata& extra,
                  const std::string& log_record) const {
  const fs::path root = ckpt_root();
  const std::string name = step_dir_name(step);
  const fs::path dir = root / name, tmp = root / (name + ".tmp");
  // Weights that became NaN or Inf are never saved over good ones.
  check_weights_finite(model, "not saving the checkpoint of step " + std::to_string(step),
                       "training went wrong (lower --lr); the checkpoints already saved are "
                       "untouched" +
                           last_checkpoint_note());
  std::error_code ec;
  // This very step saved already and named by `latest` (a stop right after a periodic save): it
  // is not saved again. Replacing it would leave `latest` naming nothing between the removal and
  // the rename, and a second signal or kill -9 there would lose the run.
  const fs::path latest_file = fs::path(out_dir_) / "latest";
  if (fs::is_directory(fs::symlink_status(dir, ec)) &&
      fs::is_regular_file(fs::symlink_status(latest_file, ec))) {
    std::string named;
    try {
      named = read_small_file(latest_file.string(), 4096, "a run's latest");
    } catch (const Error&) {
    }
    if (named == name + "\n") return;
  }
  check_own_checkpoints();
  check_replaceable(tmp, step, out_dir_);
  check_replaceable(dir, step, out_dir_);
  try {
    fs::create_directories(root);
    fs::remove_all(tmp, ec);
    fs::create_directories(tmp);
    Metadata meta = extra;
    meta.insert({{"tokenizer", tokenizer_ref_},
                 {"step", std::to_string(step)},
                 {kConfigHashKey, config_hash_},
                 {kTokenizerHashKey, tokenizer_hash_},
                 {kRuntimeKey, runtime_}});
    save_model((tmp / "model.safetensors").string(), model, meta);
    save_optimizer((tmp / "optimizer.safetensors").string(), model, opt, meta);
    if (!tokenizer_path_.empty()) {
      write_file_atomic((tmp / fs::path(tokenizer_path_).filename()).string(), tokenizer_data_);
    }
    if (!log_record.empty()) write_file_atomic((tmp / kLogRecordFile).string(), log_record);
    fsync_dir(tmp.string());
    fs::remove_all(dir, ec);
    fs::rename(tmp, dir);
    fsync_dir(root.string());
  } catch (const std::exception& e) {  // attnres::Error or std::filesystem::filesystem_error
    fs::remove_all(tmp, ec);
    // (with no checkpoint before it there is nothing to continue: the first save failed, and
    // the message pointed at a `latest` that did not exist; seventeenth hostile pass)
    const fs::path latest = fs::path(out_dir_) / "latest";
    // (a run directory moved during the save took its checkpoints along: "no checkpoint had
    // been saved" was false; eighteenth hostile pass)
    check(fs::exists(out_dir_, ec),
          "saving the checkpoint of step " + std::to_string(step) + " failed: the run directory '" +
              out_dir_ +
              "' is gone (moved or deleted while it saved); its checkpoints went with it: "
              "continue with `attnres train --resume --out <where it is now>`");
    throw Error("saving the checkpoint of step " + std::to_string(step) +
                " failed: " + cause_of(e) +
                (fs::exists(latest, ec)
                     ? ". The previous checkpoint (named in '" + latest.string() +
                           "') is intact; fix the cause and continue with `attnres train "
                           "--resume --out " +
                           shell_word(out_dir_) + "`"
                     : ". No checkpoint of this run had been saved yet; fix the cause and start "
                       "it again"));
  }
  write_file_atomic((fs::path(out_dir_) / "latest").string(), name + "\n");
  prune(name);
}

namespace {

constexpr decltype(statfs::f_type) kOverlayFsMagic = 0x794c7630;  // OVERLAYFS_SUPER_MAGIC

std::string mib_text(double bytes) { return std::to_string(std::llround(bytes / (1 << 20))); }

// The bytes and inodes that removing `p` (a file, or a directory and its files) would free:
// files linked elsewhere free nothing.
struct Freed {
  double bytes = 0, inodes = 0;
};
Freed freed_by_removing(const fs::path& p) {
  Freed f;
  std::error_code ec;
  auto add = [&f](const fs::path& q) {
    struct stat st {};
    if (::lstat(q.c_str(), &st) != 0) return;
    if (S_ISDIR(st.st_mode)) f.inodes += 1;
    if (S_ISREG(st.st_mode) && st.st_nlink == 1) {
      f.bytes += static_cast<double>(st.st_size);
      f.inodes += 1;
    }
  };
  add(p);
  if (!fs::is_directory(fs::symlink_status(p, ec))) return f;
  for (auto it = fs::recursive_directory_iterator(p, ec); !ec && it != fs::end(it);
       it.increment(ec)) {
    add(it->path());
  }
  return f;
}

}  // namespace

void RunDir::check_room_to_save(int64_t params, size_t tensors, int64_t last_step,
                                int64_t save_every, double log_bytes, bool reclaimed) const {
  // The longest path a save writes: checkpoints/step_N.tmp/optimizer.safetensors.tmp.<pid>.<n>.
  std::error_code ec;
  const fs::path abs = fs::absolute(out_dir_, ec);
  const size_t longest = abs.string().size() + std::string("/checkpoints/").size() +
                         step_dir_name(last_step).size() +
                         std::string(".tmp/optimizer.safetensors.tmp.4294967295.4294967295").size();
  check(longest < PATH_MAX, "--out '" + out_dir_ + "' is too long a path: the run's checkpoint " +
                                "files under it would reach " + std::to_string(longest) +
                                " characters, more than this system's " +
                                std::to_string(PATH_MAX - 1) + "; use a shorter --out");
  // The files' sizes: the floats, plus headers (a tensor's entry, and the metadata).
  const double per_file = 256.0 * static_cast<double>(tensors) + (64 << 10);
  const double model = 4.0 * static_cast<double>(params) + per_file;
  const double optimizer = 8.0 * static_cast<double>(params) + 2 * per_file;
  // (Only before an --overwrite: elsewhere a save that fails keeps the checkpoints before it and
  // says so, and a limit lowered while a run trains is met only there.)
  struct rlimit rl {};
  if (reclaimed && ::getrlimit(RLIMIT_FSIZE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    check(static_cast<double>(rl.rlim_cur) >= log_bytes,
          "the file-size limit (ulimit -f) is " + mib_text(static_cast<double>(rl.rlim_cur)) +
              " MiB, but this run's metrics.jsonl grows to about " + mib_text(log_bytes) +
              " MiB; nothing was deleted or trained: raise the limit (ulimit -f unlimited), or "
              "log less often (--log-every, --eval-every) or train fewer --steps");
    check(static_cast<double>(rl.rlim_cur) >= optimizer,
          "the file-size limit (ulimit -f) is " + mib_text(static_cast<double>(rl.rlim_cur)) +
              " MiB, but this run's optimizer.safetensors takes about " + mib_text(optimizer) +
              " MiB, so its checkpoints could not be saved; nothing was deleted or trained: "
              "raise the limit (ulimit -f unlimited) or make the model smaller");
  }
  struct statvfs fsst {};
  if (::statvfs(out_dir_.c_str(), &fsst) != 0) return;  // (unknown: the save says what fails)
  const double free_now = static_cast<double>(fsst.f_bavail) * static_cast<double>(fsst.f_frsize);
  // On an overlay file system (a container's), the old run's files may be in a lower layer:
  // deleting them frees nothing there and leaves a whiteout file for each. They were counted as
  // freed: the old run was deleted, then a save found the disk full (25th hostile pass).
  struct statfs sf {};
  const bool overlay = ::statfs(out_dir_.c_str(), &sf) == 0 && sf.f_type == kOverlayFsMagic;
  double freed = 0, freed_inodes = 0;
  if (reclaimed) {
    for (const char* n : {"model.safetensors", "checkpoints"}) {
      const Freed f = freed_by_removing(fs::path(out_dir_) / n);
      freed += overlay ? 0 : f.bytes;
      freed_inodes += overlay ? -f.inodes : f.inodes;
    }
  }
  const std::string overlay_note =
      overlay && reclaimed ? " (an overlay file system: deleting the old run may free nothing)"
                           : "";
  // Before an --overwrite, every checkpoint the run holds at once: --keep-checkpoints of them,
  // and one more while a save writes before pruning (one checkpoint counted only that the first
  // save would fit; 22nd hostile pass). Elsewhere the first save and the final model: a later
  // save that fails keeps the checkpoints before it.
  const int64_t saves = (save_every > 0 ? (last_step - 1) / save_every : 0) + 1;
  const int64_t held = reclaimed ? std::min(saves, keep_ + 1) : 1;
  const double checkpoint = model + optimizer + static_cast<double>(tokenizer_data_.size());
  const double need = static_cast<double>(held) * checkpoint + model + log_bytes + (1 << 20);
  check(
      free_now + freed >= need,
      "the file system of --out '" + out_dir_ + "' has " + mib_text(free_now) + " MiB free" +
          (reclaimed ? " (" + mib_text(free_now + freed) + " once --overwrite deletes the old run)"
                     : std::string()) +
          overlay_note + ", but " +
          (held > 1 ? "the " + std::to_string(held) +
                          " checkpoints this run holds at once (it keeps --keep-checkpoints " +
                          std::to_string(keep_) + " and writes one more before pruning)"
                    : std::string("a checkpoint of this run")) +
          " and its final model (and its log) take about " + mib_text(need) +
          " MiB; nothing was deleted or trained: free some space, " +
          (held > 1 ? "lower --keep-checkpoints, " : "") + "or use another --out");
  // And the files: a checkpoint is a directory of three or four files (each written under a
  // temporary name first), beside checkpoints/, the final model, `latest`, the log (a file
  // system out of inodes with bytes to spare lost an --overwrite's old run; 23rd hostile pass).
  if (fsst.f_files == 0) return;  // (a file system without an inode count)
  const double inodes = static_cast<double>(held) * 5 + 6;
  const double free_inodes = static_cast<double>(fsst.f_favail);
  check(free_inodes + freed_inodes >= inodes,
        "the file system of --out '" + out_dir_ + "' has room for " +
            std::to_string(static_cast<int64_t>(free_inodes)) + " more files" +
            (reclaimed ? " (" + std::to_string(static_cast<int64_t>(free_inodes + freed_inodes)) +
                             " once --overwrite deletes the old run)"
                       : std::string()) +
            overlay_note + ", but this run's checkpoints and final model need about " +
            std::to_string(static_cast<int64_t>(inodes)) +
            " (it is out of inodes); nothing was deleted or trained: delete files there, " +
            (held > 1 ? "lower --keep-checkpoints, " : "") + "or use another --out");
}

void RunDir::check_own_checkpoints() const {
  std::error_code ec;
  check(!fs::is_symlink(fs::symlink_status(ckpt_root(), ec)),
        "'" + ckpt_root() +
            "' is a symbolic link: a run saves into and prunes only checkpoints of its own, and "
            "through a link it would change another directory's (a copy of a run made with the "
            "link shares its original's). Put a directory of its own there (move the files "
            "back), or link the whole --out directory instead");
}

void RunDir::check_later_saves_clear(int64_t step, int64_t last) const {
  check_own_checkpoints();
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(ckpt_root(), ec)) {
    const int64_t n = step_of_name(e.path().filename().string());
    if (n > step && n <= last) check_replaceable(e.path(), n, out_dir_);
  }
}

std::string RunDir::latest() const {
  const fs::path p = fs::path(out_dir_) / "latest";
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(p, ec))) {
    // A save renames its checkpoint into place before `latest` names it: a kill (or a full disk)
    // in between leaves a complete checkpoint that nothing names. The newest such is the run's.
    std::string newest;
    for (const auto& e : fs::directory_iterator(ckpt_root(), ec)) {
      const std::string n = e.path().filename().string();
      if (n.find('.') == std::string::npos && is_saved_checkpoint(e.path()) &&
          fs::is_regular_file(e.path() / "model.safetensors", ec) &&
          fs::is_regular_file(e.path() / "optimizer.safetensors", ec) &&
          (newest.empty() || step_of_name(n) > step_of_name(newest))) {
        newest = n;
      }
    }
    check(!newest.empty(), "nothing to resume in '" + out_dir_ +
                               "': it has no 'latest' checkpoint; start the run without --resume");
    return (fs::path(ckpt_root()) / newest).string();
  }
  std::string name = read_small_file(p.string(), 4096, "a run's latest");
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  // Only a checkpoint of this run: step_<digits> in its checkpoints directory (a path such as
  // ../../other/checkpoints/step_5 would resume another run's weights).
  const bool plain = name.rfind("step_", 0) == 0 && name.size() > 5 &&
                     name.find_first_not_of("0123456789", 5) == std::string::npos;
  std::string shown;  // (at most 80 bytes, control bytes as '?')
  for (char c : name.substr(0, 80)) shown += std::isprint(static_cast<unsigned char>(c)) ? c : '?';
  check(plain, "'" + p.string() + "' names '" + shown +
                   "', not a checkpoint of this run (step_<number>); the file is corrupt or was "
                   "edited: write the name of a directory of '" +
                   ckpt_root() + "' into it");
  const fs::path dir = fs::path(ckpt_root()) / name;
  if (!fs::is_directory(dir)) {
    std::string m = "'";  // built piecewise: GCC 12 warns falsely (-Wrestrict) on one long +
    m += p.string();
    m += "' names checkpoint '";
    m += name;
    m += "', which does not exist";
    // (the run's own complete checkpoints are the way on: "start without --resume" was then
    // refused, a run being there; seventeenth hostile pass)
    m += ways_on(name);
    throw Error(m);
  }
  // (a checkpoint missing a file failed with "cannot open ...", no word of the whole ones;
  // eighteenth hostile pass)
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    if (!fs::exists(dir / f, ec)) {
      throw Error("checkpoint '" + dir.string() + "', named in '" + p.string() + "', has no " + f +
                  " (deleted?)" + ways_on(name));
    }
  }
  return dir.string();
}

std::string RunDir::ways_on(const std::string& except) const {
  std::error_code ec;
  std::string have;
  for (const auto& e : fs::directory_iterator(ckpt_root(), ec)) {
    const std::string n = e.path().filename().string();
    if (n != except && n.find('.') == std::string::npos && is_saved_checkpoint(e.path()) &&
        fs::is_regular_file(e.path() / "model.safetensors", ec) &&
        fs::is_regular_file(e.path() / "optimizer.safetensors", ec)) {
      have += (have.empty() ? "" : ", ") + n;
    }
  }
  return have.empty() ? "; the run has no other checkpoint to resume: start it again with "
                        "--overwrite"
                      : "; the run's whole checkpoints are " + have +
                            ": write the name of one into 'latest' to resume from there";
}

std::string RunDir::last_checkpoint_note() const {
  const fs::path latest = fs::path(out_dir_) / "latest";
  if (!fs::exists(latest)) return " (no checkpoint was saved before it)";
  return ". The last good checkpoint is named in '" + latest.string() + "'";
}

void RunDir::prune(const std::string& keep_name) const {
  std::vector<std::string> names;
  const int64_t saved = step_of_name(keep_name);
  for (const auto& e : fs::directory_iterator(ckpt_root())) {
    const std::string n = e.path().filename().string();
    // (a checkpoint holding a file of the user's is kept: never deleted with the old ones)
    // Only the run's lineage up to this save counts: checkpoints of later steps are those of a
    // branch the user left by rolling `latest` back. Counting them deleted the very checkpoint
    // resumed from and kept the abandoned ones (fourteenth hostile pass); they stay until this
    // run reaches their steps and replaces them.
    if (n.find(".tmp") == std::string::npos && is_saved_checkpoint(e.path()) &&
        step_of_name(n) <= saved) {
      names.push_back(n);
    }
  }
  std::sort(names.begin(), names.end());
  const int64_t excess = static_cast<int64_t>(names.size()) - keep_;
  for (int64_t i = 0; i < excess; i++) {
    if (names[i] == keep_name) continue;
    std::error_code ec;
    fs::remove_all(fs::path(ckpt_root()) / names[i], ec);
  }
}

RunLock::RunLock(const std::string& out_dir) : out_dir_(out_dir) {
  const std::string path = (fs::path(out_dir) / ".lock").string();
  dfd_ = ::open(out_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd_ < 0) {
    const int err = errno;
    throw Error("cannot lock the run directory '" + out_dir + "': " + errno_text(err));
  }
  try {
    fd_ = open_regular_file(path, O_RDWR | O_CREAT | O_NOFOLLOW, "lock the run directory with");
    // A hard link to another file (made by hand) would have that file's content replaced by the
    // pid below (twentieth hostile pass).
    struct stat st {};
    if (::fstat(fd_, &st) == 0 && st.st_nlink > 1) {
      ::close(fd_);
      fd_ = -1;
      throw Error("'" + path + "' is a hard link to another file, whose content locking would " +
                  "replace; remove '" + path + "' (the other name keeps the file)");
    }
  } catch (...) {
    ::close(dfd_);  // (a constructor that throws runs no destructor)
    throw;
  }
  if (::flock(dfd_, LOCK_EX | LOCK_NB) != 0 || ::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    char pid[32] = {0};
    const ssize_t n = ::pread(fd_, pid, sizeof pid - 1, 0);
    std::string holder = n > 0 ? std::string(pid, static_cast<size_t>(n)) : std::string("?");
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    ::close(fd_);
    ::close(dfd_);
    fd_ = dfd_ = -1;
    throw Error("another attnres process (pid " + holder + ") is training in '" + out_dir +
                "'; wait for it to finish, stop it, or use another --out (two runs in one "
                "directory would mix their checkpoints and logs)");
  }
  const std::string me = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) == 0) (void)!::pwrite(fd_, me.data(), me.size(), 0);
}

RunLock::~RunLock() {
  if (fd_ >= 0) ::close(fd_);  // (releases the locks)
  if (dfd_ >= 0) ::close(dfd_);
}

void RunLock::check_in_place() const {
  struct stat held {
  }, now{};
  const bool same = ::fstat(dfd_, &held) == 0 && ::stat(out_dir_.c_str(), &now) == 0 &&
                    held.st_dev == now.st_dev && held.st_ino == now.st_ino;
  check(same, "the run directory '" + out_dir_ +
                  "' was moved, renamed or replaced while the run trained; so as not to split the "
                  "run or mix it with another, nothing more is written. Its checkpoints are where "
                  "the directory went: continue with `attnres train --resume --out NEW_PLACE`");
}

namespace {

// Whether the regular file p, named n, holds what a run writes under that name (a user's notes
// named train_config.json or run.json were replaced or deleted by a new run: thirteenth pass).
bool looks_like_a_runs(const std::string& n, const fs::path& p) {
  if (n != "train_config.json" && n != "run.json" && n != "metrics.jsonl" && n != "latest") {
    return true;
  }
  try {
    // (a run's train_config.json, run.json and latest are small, and of metrics.jsonl only the
    // first line counts: a big file is never read whole here)
    std::string text =
        read_file_prefix(p.string(), n == "metrics.jsonl" ? size_t{1} << 20 : size_t{64} << 20);
    if (n == "latest") {  // step_<digits> and a newline, as RunDir::save writes it
      return text.size() > 6 && text.back() == '\n' &&
             is_step_name(text.substr(0, text.size() - 1));
    }
    if (n == "metrics.jsonl") {
      if (text.empty()) return true;
      text.resize(std::min(text.find('\n'), text.size()));  // (its first line)
    }
    // (marks of what attnres writes, not of any JSON: another trainer's log or a user's notes
    // under these common names are theirs, fourteenth hostile pass)
    const nlohmann::json j = nlohmann::json::parse(text);
    if (!j.is_object()) return false;
    auto has = [&](std::initializer_list<const char*> keys) {
      for (const char* k : keys) {
        if (!j.contains(k)) return false;
      }
      return true;
    };
    if (n == "train_config.json") {
      return has({"model", "steps", "corpus_fingerprint", "tokenizer_fingerprint", "out_dir",
                  "router_lr_mult"}) &&
             j["model"].is_object() && j["model"].contains("residual");
    }
    if (n == "run.json") return has({"group", "seed", "settings", "init_hash", "curve"});
    // metrics.jsonl: its first line is a step's (loss, or a skipped step) or an evaluation's
    return has({"step"}) && j["step"].is_number_integer() &&
           (has({"elapsed_s", "tokens"}) || (has({"skipped"}) && j["skipped"] == true));
  } catch (const std::bad_alloc&) {  // (out of memory says nothing of the file: seventeenth
    throw;                           //  pass's "'latest' is not what an attnres run writes")
  } catch (const std::exception&) {  // (unreadable, not JSON: not a run's)
    return false;
  }
}

}  // namespace

void check_out_not_in_checkpoints(const std::string& out_dir) {
  const fs::path d = out_dir;
  {  // Another run's checkpoints/ or one of its checkpoints is that run's, never a new run's place.
    std::error_code ec;  // (links resolved: a link to a checkpoint is that checkpoint)
    fs::path a = fs::weakly_canonical(fs::absolute(d), ec);
    if (ec) a = fs::absolute(d).lexically_normal();
    const fs::path p = a.has_filename() ? a : a.parent_path();
    auto is_run = [](const fs::path& r) {
      std::error_code e;
      return fs::exists(fs::symlink_status(r / "latest", e)) ||
             fs::exists(fs::symlink_status(r / "train_config.json", e));
    };
    const bool inside =
        (p.filename() == "checkpoints" && is_run(p.parent_path())) ||
        (p.parent_path().filename() == "checkpoints" && is_run(p.parent_path().parent_path()));
    check(!inside, "--out '" + out_dir +
                       "' is inside another run's checkpoints/ directory, whose files belong to "
                       "that run (a new run there would replace a checkpoint's weights); use "
                       "another --out");
  }
}

namespace {

// Whether p is a mount point: the root of a mount (a bind mount from the same file system too),
// as the kernel says (Linux 5.8+); before that, another device than its directory's. (Not the
// device alone where the kernel knows: on an overlay file system a file's st_dev can be its
// layer's, and every file would look mounted.)
bool mount_point(const fs::path& p) {
  struct statx sx {};
  if (::statx(AT_FDCWD, p.c_str(), AT_SYMLINK_NOFOLLOW, STATX_BASIC_STATS, &sx) == 0 &&
      (sx.stx_attributes_mask & STATX_ATTR_MOUNT_ROOT) != 0) {
    return (sx.stx_attributes & STATX_ATTR_MOUNT_ROOT) != 0;
  }
  struct stat st {};
  struct stat up {};
  const fs::path parent = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  return ::lstat(p.c_str(), &st) == 0 && ::lstat(parent.c_str(), &up) == 0 &&
         st.st_dev != up.st_dev;
}

// Whether p, a regular file or a directory, is immutable or append-only (chattr +i / +a): then it
// cannot be deleted or renamed over, nor (a directory) lose entries. "" when neither, or when its
// flags cannot be read.
std::string flag_pin(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return "";
  int flags = 0;
  const bool got = ::ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0;
  ::close(fd);
  if (got && (flags & FS_IMMUTABLE_FL) != 0) return "immutable (chattr +i)";
  if (got && (flags & FS_APPEND_FL) != 0) return "append-only (chattr +a)";
  return "";
}

// Why p cannot be deleted: a mount point, or flag_pin's reasons; "" when it can.
std::string pinned(const fs::path& p) { return mount_point(p) ? "a mount point" : flag_pin(p); }

// Everything a deletion of p removes or changes may be removed (nothing already deleted when a
// later entry then failed: a file under checkpoints/ bind-mounted or made immutable was met after
// `latest` and the final model were gone, and both runs were lost; twenty-fourth hostile pass).
// Error naming the first entry that may not, and the fix.
void check_deletable(const fs::path& p, const fs::path& what) {
  auto refuse = [&](const fs::path& e, const std::string& why) {
    throw Error("'" + e.string() + "' is " + why + ", so '" + what.string() +
                "' cannot be deleted; nothing was deleted: " +
                (why == "a mount point" ? "unmount it" : "clear the flag (chattr -i -a)") +
                ", or use another --out");
  };
  const std::string why = pinned(p);
  if (!why.empty()) refuse(p, why);
  std::error_code ec;
  if (!fs::is_directory(fs::symlink_status(p, ec))) return;
  for (auto it = fs::recursive_directory_iterator(p, ec); !ec && it != fs::end(it);
       it.increment(ec)) {
    const std::string w = pinned(it->path());
    if (!w.empty()) refuse(it->path(), w);
  }
}

}  // namespace

std::string claim_out_dir(const std::string& out_dir, bool overwrite, bool check_only) {
  const fs::path d = out_dir;
  check_out_not_in_checkpoints(out_dir);
  auto present = [&](const char* n) { return fs::exists(fs::symlink_status(d / n)); };
  // Only what the engine wrote is ever deleted: regular files, and a checkpoints/ directory of
  // step_* directories. Anything else under those names is the user's: refused, never removed.
  // (a mount point there, e.g. checkpoints/ bind-mounted elsewhere, had its files deleted and
  // then failed with EBUSY: both runs lost; twenty-third hostile pass)
  auto mounted = [](const fs::path& p) { return mount_point(p); };
  auto ours = [&](const char* n) {
    const fs::path p = d / n;
    if (mounted(p)) return false;
    if (std::string(n) == "model.safetensors") {  // (a Hugging Face model's weights are not ours)
      return is_attnres_checkpoint(p.string());
    }
    if (std::string(n) != "checkpoints") {
      return fs::is_regular_file(fs::symlink_status(p)) && looks_like_a_runs(n, p);
    }
    if (!fs::is_directory(fs::symlink_status(p))) return false;
    for (const auto& e : fs::directory_iterator(p)) {
      if (!is_saved_checkpoint(e.path()) || mounted(e.path())) return false;
    }
    return true;
  };
  // A complete checkpoint: a step_N directory that is not a save's step_N.tmp.
  auto has_checkpoint = [&] {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(d / "checkpoints", ec)) {
      const std::string n = e.path().filename().string();
      if (n.size() < 4 || n.compare(n.size() - 4, 4, ".tmp") != 0) return true;
    }
    return false;
  };
  std::vector<std::string> kept, stale;  // what a run leaves to lose / only its start's files
  for (const char* n : {"latest", "model.safetensors"}) {
    if (present(n)) kept.push_back(n);
  }
  if (present("checkpoints")) (has_checkpoint() ? kept : stale).push_back("checkpoints");
  // (run.json: compare's record of the run that was here; a new run is not that one)
  for (const char* n : {"train_config.json", "metrics.jsonl", "run.json"}) {
    if (present(n)) stale.push_back(n);
  }
  for (const auto& v : {kept, stale}) {
    for (const std::string& n : v) {
      check(ours(n.c_str()), "'" + (d / n).string() +
                                 "' is not what an attnres run writes there (a directory, a "
                                 "special file, a symlink, other files, or a mount point"
                                 "); it is left alone: move it away or use "
                                 "another --out");
    }
  }
  // A tokenizer.model with no run beside it is another's (an import-hf checkpoint's, a user's):
  // the new run would replace it, and the checkpoint it belongs to could no longer be read.
  // (Checked at the start: by stage 5 the new run's own tokenizer is there.)
  // (tokens.bin beside it: a run that was stopped while preparing its data.)
  // (Or its trainkey: stopped after training the tokenizer, before its tokens were written.)
  check(!check_only || !kept.empty() || !stale.empty() || present("tokens.bin") ||
            present("tokenizer.model.trainkey") || !present("tokenizer.model"),
        "'" + (d / "tokenizer.model").string() + "' is not a run's (no run is in '" + out_dir +
            "'; e.g. the tokenizer of an import-hf checkpoint there): a new run would replace it; "
            "use another --out");
  // The names a run's data takes in --out: a stranger there is refused now. (--overwrite
  // prepares the new data elsewhere and moves it in only after deleting the old run: meeting a
  // directory or a user's file then lost both runs; fourteenth hostile pass.)
  if (check_only) {
    auto regular_or_absent = [&](const char* n) {
      return !present(n) || (fs::is_regular_file(fs::symlink_status(d / n)) && !mounted(d / n));
    };
    for (const char* n : {"tokens.bin", "tokenizer.model", "tokenizer.model.trainkey"}) {
      check(regular_or_absent(n), "'" + (d / n).string() +
                                      "' is not what an attnres run writes there (a directory, "
                                      "a special file, a symlink or a mount point); it is left "
                                      "alone: move it away or use another --out");
      // (the new run's data replaces them after the old run is deleted: an immutable one
      // failed then, with the old run gone; twenty-fourth hostile pass)
      if (overwrite && present(n)) check_deletable(d / n, d / n);
    }
    check(!present("tokens.bin") || is_token_cache_file((d / "tokens.bin").string()),
          "'" + (d / "tokens.bin").string() +
              "' is not a token cache, and a run keeps its tokens under that name: it is left "
              "alone; move it away, or use another --out");
    check(!present("tokenizer.model") || present("tokenizer.model.trainkey"),
          "'" + (d / "tokenizer.model").string() +
              "' was not prepared by attnres (no tokenizer.model.trainkey beside it), and a run "
              "keeps its tokenizer under that name: it is left alone; move it away, pass it as "
              "--tokenizer-model, or use another --out");
  }
  auto list = [](const std::vector<std::string>& v) {
    std::string s;
    for (const std::string& n : v) s += (s.empty() ? "" : ", ") + n;
    return s;
  };
  check(kept.empty() || overwrite,
        "'" + out_dir + "' already holds a run (" + list(kept) +
            "); continue it with --resume, start this one in another --out, or pass --overwrite "
            "to delete that run and start again");
  // Everything is deleted or nothing: a directory the user may not change (a checkpoint made
  // read-only) stopped the deletion half way (23rd hostile pass).
  auto writable = [](const fs::path& dir) { return ::access(dir.c_str(), W_OK | X_OK) == 0; };
  for (const auto& v : {kept, stale}) {
    for (const std::string& n : v) {
      const fs::path p = d / n;
      check_deletable(p, p);
      std::vector<fs::path> dirs = {d};
      std::error_code ec;
      if (fs::is_directory(fs::symlink_status(p, ec))) {
        dirs.push_back(p);
        for (const auto& e : fs::directory_iterator(p, ec)) {
          if (fs::is_directory(fs::symlink_status(e.path(), ec))) dirs.push_back(e.path());
        }
      }
      for (const fs::path& dir : dirs) {
        check(writable(dir), "'" + dir.string() +
                                 "' cannot be changed (no write permission), so '" + p.string() +
                                 "' cannot be deleted; nothing was deleted: give "
                                 "write permission (chmod u+w), or use another --out");
      }
    }
  }
  const std::string dir_pin = flag_pin(d);
  check(dir_pin.empty() || (kept.empty() && stale.empty()),
        "'" + out_dir + "' is " + dir_pin +
            ", so the previous run's files in it cannot be deleted; nothing was deleted: clear "
            "the flag (chattr -i -a), or use another --out");
  if (check_only) return "";
  std::vector<std::string> gone;
  for (const auto& v : {kept, stale}) {
    for (const std::string& n : v) {
      std::error_code ec;
      fs::remove_all(d / n, ec);
      check(!ec, "--overwrite: deleting '" + (d / n).string() + "' failed (" + ec.message() + ")" +
                     (gone.empty() ? std::string() : " after deleting " + list(gone)) +
                     "; the rest of the previous run is as it was");
      gone.push_back(n);
    }
  }
  std::vector<std::string> all = kept;
  all.insert(all.end(), stale.begin(), stale.end());
  if (!kept.empty()) return "--overwrite: deleted the previous run's " + list(all);
  if (!stale.empty()) {
    return "replaced the " + list(stale) + " of a run that stopped before its first checkpoint";
  }
  return "";
}

std::string first_stranger_in_run_dir(const std::string& dir) {
  static const char* const kFiles[] = {
      "latest",        "model.safetensors", "train_config.json",
      "metrics.jsonl", "tokenizer.model",   "tokenizer.model.trainkey",
      "tokens.bin",    "run.json",          ".lock"};
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    const fs::file_status st = fs::symlink_status(e.path());
    bool ours = false;
    if (n == "checkpoints" && fs::is_directory(st)) {
      ours = true;
      for (const auto& c : fs::directory_iterator(e.path())) ours &= is_saved_checkpoint(c.path());
    } else if (fs::is_regular_file(st)) {
      for (const char* f : kFiles) ours |= n == f || is_temp_of(n, {f});
      // (a user's notes under a run's file name are theirs: fourteenth hostile pass)
      ours = ours && looks_like_a_runs(n, e.path()) &&
             (n != "tokens.bin" || is_token_cache_file(e.path().string()));
    }
    if (!ours) return n;
  }
  return "";
}

}  // namespace attnres
