// corpus.cpp — reading a text corpus from a file or a directory tree.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>
#include <system_error>

#include "attnres/data.hpp"
#include "attnres/error.hpp"

namespace attnres {

namespace fs = std::filesystem;

namespace {

bool in_range(unsigned char c, unsigned char lo, unsigned char hi) { return c >= lo && c <= hi; }

// Length of the valid UTF-8 sequence at s[i], or 0 if invalid; on invalid, *bad is the length of
// the maximal invalid subpart (>= 1) to replace by a single U+FFFD.
size_t utf8_valid_len(std::string_view s, size_t i, size_t* bad) {
  const unsigned char c = static_cast<unsigned char>(s[i]);
  size_t need;
  unsigned char lo = 0x80, hi = 0xbf;  // allowed range of the first continuation byte
  if (c < 0x80) return 1;
  if (in_range(c, 0xc2, 0xdf)) {
    need = 1;
  } else if (c == 0xe0) {
    need = 2;
    lo = 0xa0;  // excludes overlong 3-byte forms
  } else if (in_range(c, 0xe1, 0xec) || in_range(c, 0xee, 0xef)) {
    need = 2;
  } else if (c == 0xed) {
    need = 2;
    hi = 0x9f;  // excludes UTF-16 surrogates
  } else if (c == 0xf0) {
    need = 3;
    lo = 0x90;  // excludes overlong 4-byte forms
  } else if (in_range(c, 0xf1, 0xf3)) {
    need = 3;
  } else if (c == 0xf4) {
    need = 3;
    hi = 0x8f;  // excludes code points above U+10FFFF
  } else {
    *bad = 1;
    return 0;
  }
  for (size_t k = 1; k <= need; ++k) {
    if (i + k >= s.size()) {
      *bad = k;
      return 0;
    }
    const unsigned char d = static_cast<unsigned char>(s[i + k]);
    const bool ok = k == 1 ? in_range(d, lo, hi) : in_range(d, 0x80, 0xbf);
    if (!ok) {
      *bad = k;
      return 0;
    }
  }
  return need + 1;
}

struct Entry {
  std::string path;       // as found under the root
  std::string canonical;  // resolved target, for symlink de-duplication
  bool is_symlink = false;
};

std::string reason(const std::string& path, const std::string& why) {
  return path + " (" + why + ")";
}

// What attnres wrote in directory p, if it is one of its outputs: "an attnres run directory"
// (train_config.json with a log or checkpoints), "an attnres comparison directory"
// (results.json of compare or scale); nullptr for anything else.
const char* attnres_output(const fs::path& p) {
  std::error_code ec;
  if (fs::exists(p / "train_config.json", ec) &&
      (fs::exists(p / "metrics.jsonl", ec) || fs::exists(p / "checkpoints", ec) ||
       fs::exists(p / "latest", ec))) {
    return "an attnres run directory";
  }
  if (fs::exists(p / "results.json", ec) && fs::is_directory(p / "runs", ec)) {
    return "an attnres comparison directory";
  }
  return nullptr;
}

// Depth-first walk in sorted name order; regular files and symlinks to files become entries,
// everything else is recorded in `skipped`.
void walk(const fs::path& dir, const std::string& exclude, std::vector<Entry>& out,
          std::vector<std::string>& skipped) {
  std::error_code ec;
  std::vector<fs::path> children;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    children.push_back(it->path());
  }
  if (ec) {
    skipped.push_back(reason(dir.string(), "unreadable directory: " + ec.message()));
    return;
  }
  std::sort(children.begin(), children.end(), [](const fs::path& a, const fs::path& b) {
    return a.filename().native() < b.filename().native();
  });
  for (const fs::path& p : children) {
    const std::string ps = p.string();
    if (p.filename().native().front() == '.') {
      skipped.push_back(reason(ps, "hidden"));
      continue;
    }
    fs::file_status ls = fs::symlink_status(p, ec);
    if (ec) {
      skipped.push_back(reason(ps, "cannot stat: " + ec.message()));
      continue;
    }
    if (fs::is_symlink(ls)) {
      fs::file_status ts = fs::status(p, ec);
      if (ec || !fs::exists(ts)) {
        skipped.push_back(reason(ps, "broken symlink"));
      } else if (fs::is_directory(ts)) {
        // Not followed: directory symlinks can form cycles or pull in unrelated trees.
        skipped.push_back(reason(ps, "symlink to a directory, not followed"));
      } else if (fs::is_regular_file(ts)) {
        fs::path c = fs::canonical(p, ec);
        out.push_back(Entry{ps, ec ? ps : c.string(), true});
      } else {
        skipped.push_back(reason(ps, "symlink to a non-regular file"));
      }
    } else if (fs::is_directory(ls)) {
      if (!exclude.empty() && fs::equivalent(p, exclude, ec)) {
        skipped.push_back(reason(ps, "output directory, excluded"));
        continue;
      }
      // Another attnres run or comparison (its logs and configurations are text, not corpus).
      if (const char* kind = attnres_output(p)) {
        skipped.push_back(reason(ps, std::string(kind) + ", excluded"));
        continue;
      }
      walk(p, exclude, out, skipped);
    } else if (fs::is_regular_file(ls)) {
      fs::path c = fs::canonical(p, ec);
      out.push_back(Entry{ps, ec ? ps : c.string(), false});
    } else {
      skipped.push_back(reason(ps, "not a regular file"));
    }
  }
}

}  // namespace

int64_t append_sanitized_utf8(std::string_view in, std::string& out) {
  static const char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD
  int64_t replaced = 0;
  size_t i = 0, run = 0;  // [run, i) is a pending run of valid bytes, appended in bulk
  out.reserve(out.size() + in.size());
  while (i < in.size()) {
    if (static_cast<unsigned char>(in[i]) < 0x80) {
      ++i;
      continue;
    }
    size_t bad = 0;
    size_t len = utf8_valid_len(in, i, &bad);
    if (len > 0) {
      i += len;
      continue;
    }
    out.append(in.data() + run, i - run);
    out.append(kReplacement, 3);
    ++replaced;
    i += bad;
    run = i;
  }
  out.append(in.data() + run, in.size() - run);
  return replaced;
}

Corpus read_corpus(const std::string& path, const std::string& exclude_dir) {
  {
    std::error_code e1;
    check(exclude_dir.empty() || !fs::is_directory(path, e1) ||
              !fs::equivalent(path, exclude_dir, e1),
          "the corpus directory '" + path +
              "' is the run's output directory (--out): the run would read its own log, "
              "configuration and checkpoints as text; put the corpus and the run in different "
              "directories");
    if (fs::is_directory(path, e1)) {
      if (const char* kind = attnres_output(path)) {
        throw Error("the corpus directory '" + path + "' is " + kind +
                    ", not text to train on; give the directory of the text files");
      }
    }
  }
  Corpus c;
  std::error_code ec;
  fs::file_status st = fs::status(path, ec);
  const std::error_code why = ec;
  if (!path.empty() && !fs::exists(st) && fs::is_symlink(fs::symlink_status(path, ec))) {
    throw Error("corpus '" + path + "' is a symlink that leads nowhere (a broken link or a loop: " +
                why.message() + "); point it at a text file or a directory");
  }
  check(!path.empty() && fs::exists(st),
        "corpus '" + path + "' does not exist; check the data path");

  std::vector<Entry> entries;
  if (fs::is_directory(st)) {
    walk(fs::path(path), exclude_dir, entries, c.skipped);
  } else {
    check(fs::is_regular_file(st), "corpus '" + path +
                                       "' is not a regular file or directory; "
                                       "give a UTF-8 text file or a directory of them");
    entries.push_back(Entry{path, path, false});
  }
  const bool single_file = !fs::is_directory(st);

  // A symlink is redundant if its target is also reached as a plain file anywhere in the tree,
  // whichever comes first in sorted order (e.g. fortunes' "art.u8 -> art").
  std::set<std::string> plain_targets, included;
  for (const Entry& e : entries) {
    if (!e.is_symlink) plain_targets.insert(e.canonical);
  }

  bool first = true;
  for (const Entry& e : entries) {
    if (included.count(e.canonical) || (e.is_symlink && plain_targets.count(e.canonical))) {
      c.skipped.push_back(reason(e.path, "duplicate of included file '" + e.canonical + "'"));
      continue;
    }
    std::string bytes;
    try {
      // A binary file is found by its first block, before it is read whole (an archive of
      // gigabytes beside the text would take its size in memory just to be skipped).
      const std::string head = read_file_prefix(e.path, 1 << 16);
      // NOLINTNEXTLINE(bugprone-not-null-terminated-result): a search, not a copy
      if (std::memchr(head.data(), '\0', head.size()) == nullptr)
        bytes = read_file(e.path);
      else
        bytes = head;
    } catch (const Error& err) {
      if (single_file) throw;
      c.skipped.push_back(reason(e.path, std::string("unreadable: ") + err.what()));
      continue;
    }
    // NOLINTNEXTLINE(bugprone-not-null-terminated-result): a search, not a copy
    if (std::memchr(bytes.data(), '\0', bytes.size()) != nullptr) {
      check(!single_file, "corpus file '" + path +
                              "' is binary (contains NUL bytes); give a "
                              "UTF-8 text file or a directory of them");
      c.skipped.push_back(reason(e.path, "binary: contains NUL bytes"));
      continue;
    }
    if (!first) c.text.push_back('\n');
    first = false;
    c.replaced_invalid_utf8 += append_sanitized_utf8(bytes, c.text);
    c.files.push_back(e.path);
    included.insert(e.canonical);
  }

  bool any_text = false;
  for (char ch : c.text) {
    if (ch != '\n') {
      any_text = true;
      break;
    }
  }
  if (!any_text) {
    std::string msg = "corpus '" + path + "' contains no text";
    if (!c.skipped.empty()) {
      msg += " (" + std::to_string(c.skipped.size()) + " entries skipped, e.g. " +
             c.skipped.front() + ")";
    }
    throw Error(msg + "; give a UTF-8 text file or a directory of them");
  }
  return c;
}

}  // namespace attnres
