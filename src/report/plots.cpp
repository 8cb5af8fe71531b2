// Runs the embedded plotting script (tools/plot_report.py) with the system's Python 3.
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "attnres/fileio.hpp"
#include "attnres/report.hpp"
#include "report/plot_script.hpp"

namespace attnres {

namespace {

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Runs `python script run_dir out_dir`; returns the exit status and the output.
int run_python(const std::string& python, const std::string& script, const std::string& run_dir,
               const std::string& out_dir, std::string& out) {
  const std::string cmd = shell_quote(python) + " " + shell_quote(script) + " " +
                          shell_quote(run_dir) + " " + shell_quote(out_dir) + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return -1;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  return ::pclose(p);
}

// The plots drawn in `tmp` replace those in run_dir by rename: a symbolic link at a plot's name is
// replaced, never written through (it would overwrite the file it points to).
void move_plots_into(const std::filesystem::path& tmp, const std::string& run_dir) {
  namespace fs = std::filesystem;
  for (const fs::directory_entry& e : fs::directory_iterator(tmp)) {
    if (e.path().extension() == ".png")
      fs::rename(e.path(), fs::path(run_dir) / e.path().filename());
  }
}

// The private plot directories (".plots.<pid>.XXXXXX") of drawings killed before they removed
// theirs (30th hostile pass: a compare killed while drawing left one for good): those whose
// process is gone and which hold only the script and plots.
void remove_abandoned_plot_dirs(const std::string& run_dir) {
  namespace fs = std::filesystem;
  const std::string prefix = ".plots.";
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run_dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(prefix, 0) != 0 || !fs::is_directory(fs::symlink_status(e.path(), ec))) continue;
    if (!writer_pid_gone(n, prefix.size())) continue;
    bool ours = true;
    for (const auto& f : fs::directory_iterator(e.path(), ec)) {
      const fs::path& m = f.path();
      ours = ours && fs::is_regular_file(fs::symlink_status(m, ec)) &&
             (m.filename() == "plot_report.py" || m.extension() == ".png" ||
              m.filename().string().rfind("plot_report.py.tmp.", 0) == 0);
    }
    if (ours && !ec) fs::remove_all(e.path(), ec);
  }
}

}  // namespace

bool render_plots(const std::string& run_dir, std::string* why) {
  namespace fs = std::filesystem;
  // The script and its plots live in a directory of our own: Python puts the script's directory
  // first on sys.path, so a json.py or matplotlib.py in run_dir (another user's results) would run.
  remove_abandoned_plot_dirs(run_dir);
  const fs::path tmp =
      make_temp_dir((fs::path(run_dir) / (".plots." + std::to_string(::getpid()) + ".")).string(),
                    "in '" + run_dir + "'");
  const std::string script = (tmp / "plot_report.py").string();
  std::error_code ec;
  try {
    write_file_atomic(script, kPlotScript);
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  // Debian's matplotlib belongs to /usr/bin/python3, which another python3 may shadow on PATH.
  std::vector<std::string> pythons;
  if (const char* env = std::getenv("ATTNRES_PYTHON")) pythons.push_back(env);
  pythons.push_back("/usr/bin/python3");
  pythons.push_back("python3");
  std::string out;
  int st = -1;
  for (const std::string& py : pythons) {
    out.clear();
    st = run_python(py, script, run_dir, tmp.string(), out);
    if (st == 0) break;
    // A Python with matplotlib whose run failed: that is the error to report (another python3
    // without matplotlib would hide it).
    const bool missing = out.find("No module named") != std::string::npos ||
                         (WIFEXITED(st) && WEXITSTATUS(st) == 127);
    if (!missing) break;
  }
  if (st == 0) {
    try {
      move_plots_into(tmp, run_dir);
    } catch (...) {
      fs::remove_all(tmp, ec);
      throw;
    }
  }
  fs::remove_all(tmp, ec);
  if (st == 0) return true;
  if (why) {
    if (out.find("No module named 'matplotlib'") != std::string::npos) {
      *why =
          "python3-matplotlib is not installed (apt-get install python3-matplotlib), then run "
          "`attnres report " +
          run_dir + "`";
    } else if (out.find("not found") != std::string::npos || WEXITSTATUS(st) == 127) {
      *why = "python3 is not installed (apt-get install python3 python3-matplotlib)";
    } else {
      *why = "the plotting script failed: " + out.substr(0, 400);
    }
  }
  return false;
}

}  // namespace attnres
