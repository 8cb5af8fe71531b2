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

// Runs `python script run_dir`; returns the exit status and the output.
int run_python(const std::string& python, const std::string& script, const std::string& run_dir,
               std::string& out) {
  const std::string cmd =
      shell_quote(python) + " " + shell_quote(script) + " " + shell_quote(run_dir) + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return -1;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  return ::pclose(p);
}

}  // namespace

bool render_plots(const std::string& run_dir, std::string* why) {
  namespace fs = std::filesystem;
  const std::string script = (fs::path(run_dir) / ".plot_report.py").string();
  write_file_atomic(script, kPlotScript);
  // Debian's matplotlib belongs to /usr/bin/python3, which another python3 may shadow on PATH.
  std::vector<std::string> pythons;
  if (const char* env = std::getenv("ATTNRES_PYTHON")) pythons.push_back(env);
  pythons.push_back("/usr/bin/python3");
  pythons.push_back("python3");
  std::string out;
  int st = -1;
  for (const std::string& py : pythons) {
    out.clear();
    st = run_python(py, script, run_dir, out);
    if (st == 0) break;
    // A Python with matplotlib whose run failed: that is the error to report (another python3
    // without matplotlib would hide it).
    const bool missing = out.find("No module named") != std::string::npos ||
                         (WIFEXITED(st) && WEXITSTATUS(st) == 127);
    if (!missing) break;
  }
  std::error_code ec;
  fs::remove(script, ec);
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
