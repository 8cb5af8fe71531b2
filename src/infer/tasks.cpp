// Downstream task scoring (attnres/tasks.hpp).
#include "attnres/tasks.hpp"

#include <cmath>
#include <nlohmann/json.hpp>
#include <sstream>

#include "attnres/data.hpp"
#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "backend/backend.hpp"
#include "core/json_field.hpp"

namespace attnres {

const char* to_string(TaskKind k) {
  return k == TaskKind::multiple_choice ? "multiple choice" : "minimal pairs";
}

namespace {

TaskItem parse_item(const nlohmann::json& j, const std::string& where, TaskKind* kind) {
  check(j.is_object(), where + " is not a JSON object");
  TaskItem it;
  const bool mc = j.contains("choices");
  const bool pair = j.contains("sentence_good") || j.contains("sentence_bad");
  check(mc != pair, where +
                        " is neither a multiple-choice item ({\"context\", \"choices\", "
                        "\"label\"}) nor a minimal pair ({\"sentence_good\", \"sentence_bad\"})");
  *kind = mc ? TaskKind::multiple_choice : TaskKind::minimal_pair;
  if (pair) {
    std::string good, bad;
    check(read_json_field(j, "sentence_good", good, where) &&
              read_json_field(j, "sentence_bad", bad, where),
          where + " needs both 'sentence_good' and 'sentence_bad'");
    check(!good.empty() && !bad.empty(), where + ": a sentence is empty");
    it.choices = {good, bad};
    return it;
  }
  read_json_field(j, "context", it.context, where);
  const nlohmann::json& c = j.at("choices");
  check(c.is_array() && c.size() >= 2, where + ": 'choices' must be a list of two or more strings");
  for (const auto& x : c) {
    check(x.is_string() && !x.get<std::string>().empty(),
          where + ": every choice must be a non-empty string");
    it.choices.push_back(x.get<std::string>());
  }
  check(read_json_field(j, "label", it.label, where), where + " has no 'label'");
  check(it.label >= 0 && it.label < static_cast<int64_t>(it.choices.size()),
        where + ": 'label' " + std::to_string(it.label) + " is not the index of a choice (0 to " +
            std::to_string(it.choices.size() - 1) + ")");
  return it;
}

// log p(cont | ctx) under `model`: the sum over cont's tokens.
double choice_loglik(Model& model, std::vector<int32_t> ctx, const std::vector<int32_t>& cont) {
  const int64_t T_max = model.config().max_seq_len;
  std::vector<int32_t> seq = std::move(ctx);
  const int64_t first = static_cast<int64_t>(seq.size());  // index of cont's first token
  seq.insert(seq.end(), cont.begin(), cont.end());
  // Inputs are seq[0, n-1); keep the last T_max of them (dropping context from the left).
  int64_t drop = std::max<int64_t>(0, static_cast<int64_t>(seq.size()) - 1 - T_max);
  check(first - drop >= 1, "a choice of " + std::to_string(cont.size()) +
                               " tokens does not fit the model's context of " +
                               std::to_string(T_max) + " tokens");
  const int64_t T = static_cast<int64_t>(seq.size()) - 1 - drop;
  model.forward(seq.data() + drop, nullptr, 1, T);
  const int64_t V = model.config().vocab_size;
  std::vector<float> host;
  const float* logits = model.logits();
  if (!model.on_cpu()) {
    host.resize(static_cast<size_t>(T * V));
    model.backend().download(host.data(), logits, static_cast<size_t>(T * V) * sizeof(float));
    logits = host.data();
  }
  double total = 0;
  for (int64_t k = first; k < static_cast<int64_t>(seq.size()); k++) {
    const float* row = logits + (k - 1 - drop) * V;
    double mx = row[0];
    for (int64_t v = 1; v < V; v++) mx = std::max(mx, static_cast<double>(row[v]));
    double sum = 0;
    for (int64_t v = 0; v < V; v++) sum += std::exp(static_cast<double>(row[v]) - mx);
    total += static_cast<double>(row[seq[k]]) - mx - std::log(sum);
  }
  return total;
}

double stderr_of(double p, int64_t n) {
  return n > 1 ? std::sqrt(p * (1 - p) / static_cast<double>(n - 1)) : std::nan("");
}

}  // namespace

Task read_task(const std::string& path) {
  Task t;
  t.path = path;
  const std::string text = read_file(path);
  t.fingerprint = hex64(fnv1a64(text));
  std::istringstream in(text);
  std::string line;
  int64_t n = 0;
  bool have_kind = false;
  while (std::getline(in, line)) {
    n++;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = "task file '" + path + "' line " + std::to_string(n);
    nlohmann::json j;
    try {
      j = parse_json(line);
    } catch (const nlohmann::json::exception& e) {
      throw Error(where + " is not valid JSON (" + e.what() + ")");
    }
    TaskKind kind;
    TaskItem it = parse_item(j, where, &kind);
    check(!have_kind || kind == t.kind, where + " is a " + std::string(to_string(kind)) +
                                            " item, but the file's first item is " +
                                            to_string(t.kind) + "; one kind per file");
    t.kind = kind;
    have_kind = true;
    t.items.push_back(std::move(it));
  }
  check(!t.items.empty(), "task file '" + path + "' has no items");
  return t;
}

TaskResult score_task(Model& model, const Tokenizer& tok, const Task& task) {
  TaskResult r;
  r.kind = task.kind;
  r.items = static_cast<int64_t>(task.items.size());
  int64_t hits = 0, hits_norm = 0;
  for (const TaskItem& it : task.items) {
    const std::vector<int32_t> ctx = tok.encode(it.context.empty() ? "\n" : it.context);
    std::vector<double> s;
    bool cut = false;
    for (const std::string& c : it.choices) {
      std::vector<int32_t> cont = tok.encode(c), before = ctx;
      check(!cont.empty(), "task file '" + task.path + "' item " +
                               std::to_string(r.logliks.size() + 1) + ": '" + c +
                               "' encodes to no tokens");
      if (before.empty()) {  // (a SentencePiece model may encode "\n" to nothing: then the
                             // choice's first token is the context, unscored)
        check(cont.size() >= 2, "task file '" + task.path + "' item " +
                                    std::to_string(r.logliks.size() + 1) + ": '" + c +
                                    "' is one token with nothing before it; give a context");
        before.push_back(cont.front());
        cont.erase(cont.begin());
      }
      // (inputs are all but the last token; choice_loglik keeps the last max_seq_len)
      cut |= static_cast<int64_t>(before.size() + cont.size()) - 1 > model.config().max_seq_len;
      s.push_back(choice_loglik(model, before, cont));
    }
    r.items_cut += cut;
    size_t best = 0, best_norm = 0;
    for (size_t k = 1; k < s.size(); k++) {
      if (s[k] > s[best]) best = k;
      if (s[k] / static_cast<double>(it.choices[k].size()) >
          s[best_norm] / static_cast<double>(it.choices[best_norm].size())) {
        best_norm = k;
      }
    }
    if (task.kind == TaskKind::minimal_pair) {
      hits += s[0] > s[1];
    } else {
      hits += static_cast<int64_t>(best) == it.label;
      hits_norm += static_cast<int64_t>(best_norm) == it.label;
    }
    r.logliks.push_back(std::move(s));
  }
  r.acc = static_cast<double>(hits) / static_cast<double>(r.items);
  r.acc_stderr = stderr_of(r.acc, r.items);
  if (task.kind == TaskKind::multiple_choice) {
    r.acc_norm = static_cast<double>(hits_norm) / static_cast<double>(r.items);
    r.acc_norm_stderr = stderr_of(r.acc_norm, r.items);
  }
  return r;
}

}  // namespace attnres
