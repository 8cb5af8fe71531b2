// attnres/tasks.hpp — downstream scoring: multiple-choice and minimal-pair task files
// (`attnres eval --task FILE.jsonl`), scored by log-likelihood as lm-evaluation-harness does.
//
// A task file is JSON Lines, one item per line, all of one kind:
//   multiple choice  {"context": "...", "choices": ["...", ...], "label": k}
//   minimal pair     {"sentence_good": "...", "sentence_bad": "..."}   (BLiMP's format)
// A choice's log-likelihood is the sum of log p(token | everything before it) over its tokens,
// after the context's tokens ("\n" when the context is empty); a sequence longer than the
// model's context keeps its last max_seq_len + 1 tokens. Multiple choice: acc = share of items
// whose labelled choice scores highest (the first on ties), acc_norm the same with each score
// divided by its choice's UTF-8 byte count. Minimal pair: acc = share of pairs whose good
// sentence is strictly more likely (an empty context for both).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attnres/model.hpp"
#include "attnres/tokenizer.hpp"

namespace attnres {

enum class TaskKind { multiple_choice, minimal_pair };
const char* to_string(TaskKind k);  // "multiple choice" / "minimal pairs"

struct TaskItem {
  std::string context;               // "" for a minimal pair
  std::vector<std::string> choices;  // minimal pair: {good, bad}
  int64_t label = 0;                 // minimal pair: 0
};

struct Task {
  std::string path;
  std::string fingerprint;  // of the file's bytes (hex FNV-1a 64): a score names what it scored
  TaskKind kind = TaskKind::multiple_choice;
  std::vector<TaskItem> items;
};

// Reads a task file; Error naming the file, the line and the key for anything malformed (not
// JSON, a missing or mistyped key, fewer than two choices, a label out of range, kinds mixed,
// no items).
Task read_task(const std::string& path);

struct TaskResult {
  TaskKind kind = TaskKind::multiple_choice;
  int64_t items = 0;
  double acc = 0, acc_stderr = 0;             // stderr: sqrt(acc (1 - acc) / (items - 1))
  double acc_norm = -1, acc_norm_stderr = 0;  // multiple choice only (-1: not defined)
  std::vector<std::vector<double>> logliks;   // (items, choices)
  int64_t items_cut = 0;  // items whose context was cut from the left to fit the model's context
};

// Scores every choice of every item with `model` (on any backend), one sequence at a time.
TaskResult score_task(Model& model, const Tokenizer& tok, const Task& task);

}  // namespace attnres
