// A training run's checkpoints (checkpoints/step_N/ in the run directory, `latest` naming the
// newest complete one): each written into a temporary directory, synced, renamed into place,
// then named in `latest`, so a crash at any moment leaves the previous checkpoint complete and
// current. The oldest beyond `keep` are removed.
#pragma once

#include <cstdint>
#include <string>

#include "attnres/checkpoint.hpp"

namespace attnres {

class AdamW;
class Model;

class RunDir {
 public:
  // tokenizer_path: the name under which each checkpoint keeps the tokenizer ("" = none, e.g.
  // bytes); tokenizer_data: its bytes, those the run loaded (not re-read from disk at each save:
  // a file replaced meanwhile would be copied into every later checkpoint).
  // config_hash: recorded in each checkpoint's metadata (kConfigHashKey): the fingerprint of the
  // run's train_config.json, so that a resume notices an edited one.
  // tokenizer_hash: the tokenizer's fingerprint (kTokenizerHashKey in each checkpoint).
  // runtime: where and how the run computes (kRuntimeKey, e.g. "cpu bf16"): the model and
  // optimizer files of one checkpoint carry the same one.
  RunDir(std::string out_dir, int64_t keep, std::string tokenizer_ref, std::string tokenizer_path,
         std::string tokenizer_data, std::string config_hash, std::string tokenizer_hash,
         std::string runtime);

  // Writes checkpoints/step_N (model, optimizer state, tokenizer) and points `latest` at it. On
  // failure (e.g. a full disk) throws Error and leaves `latest` and the checkpoint it names
  // untouched; the partial step_N.tmp directory is removed.
  // extra: more metadata for both files (e.g. the trainer's running training-loss mean).
  // log_record: the text of the checkpoint's kLogRecordFile ("" = none).
  void save(const Model& model, AdamW& opt, int64_t step, const Metadata& extra = {},
            const std::string& log_record = "") const;

  // Error when a later save of this run (a step in (step, last]) would have to replace something
  // under checkpoints/ that is not a checkpoint a save wrote (a user's file, or a checkpoint
  // directory holding one): said at the start of a resumed run, not after the steps up to it.
  void check_later_saves_clear(int64_t step, int64_t last) const;
  // Error when checkpoints/ is a symbolic link (its saves and pruning would reach another
  // directory's checkpoints, e.g. those of the run this one was copied from).
  void check_own_checkpoints() const;

  // Error when a save of this run could not be written, said before anything is deleted or
  // trained: a path under --out longer than the system takes, less free space on --out's file
  // system than one checkpoint and the final model need (with reclaimed, an --overwrite counting
  // the bytes it frees: every checkpoint the run holds at once), and with reclaimed a file-size
  // limit (ulimit -f) below the optimizer file. (An
  // --overwrite deleted the old run, and then its first save failed: both runs lost; 21st hostile
  // pass.) params: the model's floats, tensors: its tensor count, last_step: the run's last step,
  // log_bytes: how large its metrics.jsonl grows (counted too, and against the file-size limit:
  // the log filled the disk before the first save; 25th hostile pass).
  void check_room_to_save(int64_t params, size_t tensors, int64_t last_step, int64_t save_every,
                          double log_bytes, bool reclaimed) const;

  // Path of the newest complete checkpoint directory; Error if there is none.
  std::string latest() const;

  // For an error message about a failed run: where its last good checkpoint is named.
  std::string last_checkpoint_note() const;
  // "; the run's whole checkpoints are ...: write one into 'latest'" (or none): how a resume goes
  // on when the checkpoint `latest` names (except) cannot be used.
  std::string ways_on(const std::string& except) const;

 private:
  std::string ckpt_root() const;
  void prune(const std::string& keep_name) const;

  std::string out_dir_;
  int64_t keep_;
  std::string tokenizer_ref_, tokenizer_path_, tokenizer_data_, config_hash_, tokenizer_hash_,
      runtime_;
};

// Removes the staging directories (.overwrite.tmp.XXXXXX) that a `train --overwrite` killed
// while preparing its data left in out_dir, each as big as the corpus's tokens, and the temporary
// files of the run's own top-level files ("model.safetensors.tmp.<pid>.<n>", ...) whose writer is
// gone. Only directories holding nothing but the data files a run writes are removed. Call with
// out_dir's RunLock held.
void remove_abandoned_staging(const std::string& out_dir);

inline constexpr const char* kConfigHashKey = "train_config_fnv1a64";
inline constexpr const char* kRuntimeKey = "attnres_runtime";
// The sum (hex float) and count of the training losses since the last evaluation at a checkpoint.
inline constexpr const char* kRecentLossKey = "attnres_recent_train_loss_sum";
inline constexpr const char* kRecentStepsKey = "attnres_recent_train_steps";
// A checkpoint's record of metrics.jsonl as it was at the save: {"bytes": N, "fnv1a64": hex of
// those N bytes}, so a resume knows whether the log still holds what the run had measured (21st
// hostile pass). A file beside the weights, whose bytes do not depend on timing.
inline constexpr const char* kLogRecordFile = "metrics_record.json";

// One training process per run directory: holds an exclusive lock on out_dir/.lock (flock, freed
// by the kernel when the process ends, even by kill -9) from construction to destruction. Throws
// Error naming the directory and the holder's pid when another process holds it.
class RunLock {
 public:
  explicit RunLock(const std::string& out_dir);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

  // Error when out_dir no longer names the locked directory (it was moved, renamed or replaced
  // while the run trained): what the run would write next would land in another run's place, or
  // split this one in two. Called before each save.
  void check_in_place() const;

 private:
  std::string out_dir_;
  int fd_ = -1;   // .lock: holds the pid for the message of a refused second run
  int dfd_ = -1;  // the directory itself, flocked: deleting .lock or moving the run keeps the lock
};

// A new run's claim on out_dir. If it holds a run with something to lose (latest, a complete
// checkpoint or model.safetensors), throws Error saying how to continue or replace it, unless
// overwrite, which deletes the old run's files (and nothing else: not the data cache). The files
// of a run that stopped before its first checkpoint (train_config.json, metrics.jsonl, an empty
// checkpoints/ or a save's step_N.tmp) are replaced. Anything under those names that the engine
// does not write (a directory named metrics.jsonl, a FIFO, a symlink) is an Error, never deleted.
// Returns what it deleted, as a message ("" = nothing). With check_only, it only checks (and
// deletes nothing): the trainer checks first and deletes once the new run's inputs have been
// read and found good, so that a new run that cannot start loses nothing of the old one.
// Error when out_dir is another run's checkpoints/ directory or one of its checkpoints (checked
// before anything is made there: a refused --out left its .lock in the other run).
void check_out_not_in_checkpoints(const std::string& out_dir);
std::string claim_out_dir(const std::string& out_dir, bool overwrite, bool check_only = false);

// The first entry of the directory `dir` that a run (train, or compare's record of it) does not
// write there: "" when every entry is one of a run's files (a regular file of a known name, a
// writer's temp file) or its checkpoints/ directory of saved checkpoints. A caller about to
// delete `dir` refuses when it is not "" (it is the user's).
std::string first_stranger_in_run_dir(const std::string& dir);

}  // namespace attnres
