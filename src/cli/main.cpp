// attnres: train, evaluate and sample Transformer language models with Attention Residuals.
// The only place that prints errors and picks exit codes (library code throws attnres::Error).
#include <fcntl.h>
#include <omp.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <new>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "attnres/cuda.hpp"
#include "attnres/data.hpp"
#include "attnres/dist.hpp"
#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "cli/commands.hpp"
#include "cli/train_options.hpp"
#include "core/blas.hpp"

namespace {

// GNU OpenMP spins 300k iterations at every barrier before sleeping. When two attnres processes
// (or a test runner's jobs) share the cores, each barrier then waits out the other's time slice:
// measured 100x slower on 2 cores. A spin count of 3000 keeps single-process speed and removes the
// collapse. libgomp reads its environment before main(), so set it and re-execute once.
void tune_openmp_wait(char** argv) {
  if (std::getenv("GOMP_SPINCOUNT") || std::getenv("OMP_WAIT_POLICY") ||
      std::getenv("ATTNRES_OMP_TUNED")) {
    return;
  }
  ::setenv("GOMP_SPINCOUNT", "3000", 1);
  ::setenv("ATTNRES_OMP_TUNED", "1", 1);
  ::execv("/proc/self/exe", argv);  // returns only on failure: then run untuned
}

// The re-execution above names the process after the link it ran ("exe"): ps, top and pkill
// show the program's own name again (fifteen bytes at most, the kernel's limit).
void name_process(const char* argv0) {
  std::string name = argv0 ? std::filesystem::path(argv0).filename().string() : "";
  if (name.empty()) name = "attnres";
  ::prctl(PR_SET_NAME, name.substr(0, 15).c_str(), 0, 0, 0);
}

// A process started with stdin, stdout or stderr closed would get those numbers for the first files
// it opens, and its progress lines would land in metrics.jsonl or .lock: they point at /dev/null.
void open_standard_fds() {
  for (int fd = 0; fd <= 2; fd++) {
    if (::fcntl(fd, F_GETFD) == -1 && errno == EBADF) {
      const int got = ::open("/dev/null", O_RDWR);
      if (got != fd && got >= 0) ::close(got);  // fd was taken meanwhile: nothing to do
    }
  }
}

// A file the engine reads through a memory map (a checkpoint, a Hugging Face model) that another
// program cuts meanwhile faults with SIGBUS: name it and end with exit 1 instead of "Bus error".
// Nothing is written here: files already saved were saved by rename and are complete.
void on_sigbus(int sig, siginfo_t* info, void*) {
  const char* path = attnres::mapped_file_at(info->si_addr);
  if (path == nullptr) {  // not a mapped input: a real fault, with its core dump
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  const auto say = [](const char* t) { (void)!::write(2, t, std::strlen(t)); };
  say("\nerror: the file '");
  say(path);
  say("' was cut or rewritten by another program while it was being read; the command stopped "
      "(files it had saved are intact): run it again once the file is complete\n");
  ::_exit(1);
}

void install_sigbus_handler() {
  struct sigaction sa {};
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGBUS, &sa, nullptr);
}

}  // namespace

namespace attnres::cli {
namespace {
std::string g_command_line;
int g_threads = 0;
}  // namespace
int requested_threads() { return g_threads; }
void set_requested_threads(int n) { g_threads = n; }
const std::string& command_line() { return g_command_line; }
void set_command_line(int argc, char** argv) {
  g_command_line = "attnres";
  for (int i = 1; i < argc; i++) {
    const std::string a = argv[i];
    const bool plain = a.find_first_of(" '\"$`\\") == std::string::npos && !a.empty();
    g_command_line += " " + (plain ? a : "'" + a + "'");
  }
}
}  // namespace attnres::cli

namespace {

// Integer options read in decimal, leading zeros and all: CLI11 converts with base 0, so 010
// was 8 and 09 an error (fourteenth hostile pass; padded numbers are common in generated
// commands). Each integer option gets a transform, run before its checks, that drops the zeros.
void decimal_integers(CLI::App& app) {
  for (CLI::Option* o : app.get_options()) {
    const std::string type = o->get_type_name();
    if (type.rfind("INT", 0) != 0 && type.rfind("UINT", 0) != 0) continue;
    o->transform([](std::string v) {
      const size_t sign = !v.empty() && (v[0] == '-' || v[0] == '+') ? 1 : 0;
      size_t digits = sign;
      while (digits + 1 < v.size() && v[digits] == '0') digits++;
      if (digits > sign && v.find_first_not_of("0123456789", sign) == std::string::npos) {
        v.erase(sign, digits - sign);
      }
      return v;
    });
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) decimal_integers(*sub);
}

// An empty value names nothing: `--out ""` made scale write its comparisons into the working
// directory, and compare fail with a bare filesystem error (fifteenth pass). Every option that
// takes a value refuses it, except --prompt (an empty prompt is a prompt).
void no_empty_values(CLI::App& app) {
  for (CLI::Option* o : app.get_options()) {
    // A flag given a value (`--overwrite=$UNSET`, `--overwrite=2`) took it as true, and deleted
    // a run: only true/false words (or 1/0) are read, as in a --config file. So for an option
    // that takes a boolean (--attnres-two-phase 0.5 or -1 was false; eighteenth hostile pass).
    const bool boolean = o->get_type_name() == "BOOLEAN";
    if ((o->get_expected_min() == 0 || boolean) && o->get_name() != "--help") {
      o->check(CLI::Validator(
          [boolean](std::string& v) {
            std::string l = v;
            for (char& ch : l) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
            for (const char* w : {"true", "false", "1", "0", "on", "off", "yes", "no"}) {
              if (l == w) return std::string();
            }
            return "'" + v + "' is not a value for " +
                   (boolean ? std::string("this option: give true or false")
                            : std::string("a flag: give the flag alone, or =true / =false"));
          },
          "", "flag value"));
      continue;
    }
    if (o->get_name() == "--prompt") continue;
    o->check(CLI::Validator(
        [](std::string& v) {
          return v.empty() ? "an empty value; give one (or leave the option out)" : "";
        },
        "", "non-empty"));
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) no_empty_values(*sub);
}

constexpr int kMaxThreads = 4096;  // far above any machine's cores; libgomp dies at 65536
constexpr int64_t kMaxConfigBytes = 1 << 20;  // a --config file

// What CLI11's TOML/INI reader gets wrong silently, refused with the line: a [section] opened
// twice, or a key set twice however the section is spelt ([train], ["train"], train.steps = ...):
// it keeps the first value; a '#' inside a quoted value: it starts a comment there, and the
// value is cut, its opening quote kept.
std::string unquoted(std::string n) {
  n.erase(0, n.find_first_not_of(" \t"));
  n.erase(n.find_last_not_of(" \t") + 1);
  if (n.size() >= 2 && (n.front() == '"' || n.front() == '\'') && n.back() == n.front()) {
    n = n.substr(1, n.size() - 2);
  }
  return n;
}

// The --config file's sections ("" for keys before any section), for the note that none of it
// applies to the command (a [compare] section given to train was skipped without a word;
// twentieth hostile pass).
std::string g_config_path;
std::set<std::string> g_config_sections;

void check_config_text(const std::string& path) {
  g_config_path = path;
  std::istringstream in(attnres::read_file(path));
  std::map<std::string, int> first_line, first_key;
  std::string line, section;
  auto lines = [](int a, int b) {
    return " twice (lines " + std::to_string(a) + " and " + std::to_string(b) + ")";
  };
  for (int no = 1; std::getline(in, line); no++) {
    const size_t b = line.find_first_not_of(" \t");
    if (b == std::string::npos || line[b] == '#' || line[b] == ';') continue;
    if (line[b] == '[') {
      const size_t e = line.find(']', b);
      if (e == std::string::npos) continue;
      section = unquoted(line.substr(b + 1, e - b - 1));
      const auto [it, fresh] = first_line.emplace(section, no);
      attnres::check(fresh, "the --config file '" + path + "' opens the section [" + section + "]" +
                                lines(it->second, no) +
                                "; a key set in both would keep its first value: merge them "
                                "into one section");
      continue;
    }
    const size_t eq = line.find('=', b);
    if (eq == std::string::npos) continue;
    const std::string key =
        (section.empty() ? "" : section + ".") + unquoted(line.substr(b, eq - b));
    const std::string key_name = unquoted(line.substr(b, eq - b));
    // (a dotted key at the top, train.steps = 2, is that section's)
    g_config_sections.insert(
        !section.empty()
            ? section
            : key_name.substr(0, key_name.find('.') == std::string::npos ? 0 : key_name.find('.')));
    const auto [it, fresh] = first_key.emplace(key, no);
    attnres::check(fresh, "the --config file '" + path + "' sets '" + key + "'" +
                              lines(it->second, no) +
                              "; the reader would keep the first value: set it once");
    const std::string value = unquoted(line.substr(eq + 1)).empty() ? "" : line.substr(eq + 1);
    const size_t v = value.find_first_not_of(" \t");
    attnres::check(v == std::string::npos || (value[v] != '"' && value[v] != '\'') ||
                       value.find('#', v) == std::string::npos,
                   "the --config file '" + path + "' line " + std::to_string(no) +
                       ": the value of '" + key +
                       "' holds a '#' inside quotes, where the reader starts a comment and cuts "
                       "the value; give that option on the command line instead");
  }
}

// Checks what CLI11 cannot before it reads anything: the --config file is a regular file of at
// most 1 MiB (a FIFO would block it, /dev/zero would never end), and OMP_NUM_THREADS is in range.
void check_inputs_before_parsing(int argc, char** argv) {
  for (int i = 1; i < argc; i++) {
    const std::string a = argv[i];
    // Paths and options are recorded in JSON (train_config.json, results.json), which holds UTF-8
    // only; a prompt is text for the tokenizer, which takes any bytes.
    std::string shown;
    const bool prompt_value = i > 1 && std::string(argv[i - 1]) == "--prompt";
    const bool utf8 = attnres::append_sanitized_utf8(a, shown) == 0;
    attnres::check(prompt_value || utf8,
                   "the argument '" + shown +
                       "' is not valid UTF-8 (shown with U+FFFD for the bad bytes); attnres "
                       "records paths and options in JSON files, which hold UTF-8 only: rename "
                       "the file or directory");
    // `--overwrite=$UNSET`: CLI11 reads an empty value after '=' as the flag's own (true).
    attnres::check(prompt_value || a.rfind("--", 0) != 0 || a.size() < 4 || a.back() != '=' ||
                       a == "--prompt=",
                   "the argument '" + a +
                       "' gives its option an empty value (an unset shell variable?); give a "
                       "value, or the flag alone");
    std::string path;
    if (a == "--config" && i + 1 < argc) path = argv[i + 1];
    if (a.rfind("--config=", 0) == 0) path = a.substr(9);
    if (path.empty()) continue;
    const int fd = attnres::open_regular_file(path, O_RDONLY, "read the --config file");
    char head[3] = {0, 0, 0};
    const bool bom =
        ::pread(fd, head, 3, 0) == 3 && head[0] == '\xEF' && head[1] == '\xBB' && head[2] == '\xBF';
    ::close(fd);
    attnres::check(!bom, "the --config file '" + path +
                             "' starts with a UTF-8 byte-order mark, which the TOML/INI reader "
                             "does not accept; save it as UTF-8 without BOM");
    attnres::check(
        std::filesystem::file_size(path) <= kMaxConfigBytes,
        "the --config file '" + path + "' is over 1 MiB; give a TOML/INI file of options");
    check_config_text(path);
  }
  if (const char* e = std::getenv("OMP_NUM_THREADS")) {
    char* end = nullptr;
    const long n = std::strtol(e, &end, 10);
    attnres::check(end != e && n >= 1 && n <= kMaxThreads,
                   "OMP_NUM_THREADS='" + std::string(e) + "' must be a thread count in [1, " +
                       std::to_string(kMaxThreads) + "]; unset it or use --threads");
  }
}

// The TOML/INI reader with strict flags: a flag's value must be a boolean word. CLI11 took an
// empty value, "" or 2 as true, so `overwrite =` deleted a run.
class StrictFlagConfig : public CLI::ConfigTOML {
 public:
  std::string to_flag(const CLI::ConfigItem& item) const override {
    std::string v = item.inputs.size() == 1 ? item.inputs[0] : std::string();
    std::string low = v;
    for (char& ch : low) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    for (const char* ok : {"true", "false", "1", "0", "yes", "no", "on", "off"}) {
      if (low == ok) return v;
    }
    std::string given;
    for (const std::string& x : item.inputs) given += (given.empty() ? "'" : ", '") + x + "'";
    throw attnres::Error("the --config file sets the flag '" + item.fullname() + "' to " +
                         (given.empty() ? std::string("nothing") : given) +
                         "; a flag takes true or false");
  }
};

// A bug, not the user's doing: exit 2.
int internal_error(const std::exception& e) {
  std::fflush(stdout);
  std::fprintf(stderr, "\ninternal error: %s\n(please report this with the command you ran)\n",
               e.what());
  return 2;
}

// The message and exit code of the exception being handled: 1 for what the user can fix (an
// Error, out of memory, a path, a thread that could not start), 2 for an internal error.
int report_exception() {
  try {
    throw;
  } catch (const attnres::Error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "\nerror: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fflush(stdout);
    std::fprintf(stderr,
                 "\nerror: out of memory: the model, the batch or the sequences need more memory "
                 "than this process can get; lower --batch-size, --seq-len, --d-model or "
                 "--n-layer (or raise ulimit -v); files already written are intact.\n");
    return 1;
  } catch (const nlohmann::json::type_error& e) {
    std::fflush(stdout);
    if (e.id == 316) {  // dump() of a string that is not UTF-8: a path (e.g. the working dir)
      std::fprintf(stderr,
                   "\nerror: a path or text to be recorded in a JSON file is not valid UTF-8 "
                   "(%s); attnres records paths in JSON files, which hold UTF-8 only: rename the "
                   "file or directory (or the one you run from) to a UTF-8 name\n",
                   e.what());
      return 1;
    }
    return internal_error(e);
  } catch (const std::filesystem::filesystem_error& e) {
    std::fflush(stdout);
    std::fprintf(stderr,
                 "\nerror: %s; check the path (a directory cannot be made under a "
                 "file, on a read-only disk or without permission)\n",
                 e.what());
    return 1;
  } catch (const std::system_error& e) {
    // A thread that could not be started (EAGAIN: address space or process limits).
    std::fflush(stdout);
    if (e.code() == std::errc::resource_unavailable_try_again) {
      std::fprintf(stderr,
                   "\nerror: could not start a thread (%s): the process is out of memory or "
                   "threads (ulimit -v, ulimit -u); raise the limit\n",
                   e.what());
      return 1;
    }
    return internal_error(e);
  } catch (const std::exception& e) {
    return internal_error(e);
  }
}

// oneDNN splits a product over omp_get_max_threads() threads and computes only the parts of the
// threads it gets: under OMP_THREAD_LIMIT below the count, OMP_DYNAMIC=true or
// OMP_MAX_ACTIVE_LEVELS=0 every product was partly left out (a wrong loss, exit 0). The team asked
// for is the team given: no dynamic teams, one active level, at most the thread limit.
void use_every_requested_thread() {
  omp_set_dynamic(0);
  if (omp_get_max_active_levels() < 1) omp_set_max_active_levels(1);
  if (omp_get_max_threads() > omp_get_thread_limit()) omp_set_num_threads(omp_get_thread_limit());
}

// The output of a command whose product is what it prints (eval, generate, info, ...) must have
// been written: to a full disk or /dev/full it was lost with exit 0.
bool g_output_is_the_product = false;

int check_output_written(int code) {
  errno = 0;
  const bool failed = std::fflush(stdout) != 0 || std::ferror(stdout);
  if (!failed || !g_output_is_the_product || code != 0) return code;
  const int err = errno;
  std::fprintf(stderr,
               "\nerror: the output could not be written to stdout%s%s; free space or "
               "send it elsewhere\n",
               err ? ": " : "", err ? std::strerror(err) : "");
  return 1;
}

// The --config file's path on the command line ("" without one).
std::string config_path(int argc, char** argv) {
  std::string path;
  for (int i = 1; i < argc; i++) {
    const std::string a = argv[i];
    if (a == "--config" && i + 1 < argc) path = argv[i + 1];
    if (a.rfind("--config=", 0) == 0) path = a.substr(9);
  }
  return path;
}

// Whether the --config file has a line setting `key` ("key = ..." or "key=..."; also with
// underscores for dashes, as CLI11 reads it).
bool config_sets(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  std::string under = key;
  std::replace(under.begin(), under.end(), '-', '_');
  for (std::string line; std::getline(in, line);) {
    const size_t b = line.find_first_not_of(" \t");
    if (b == std::string::npos) continue;
    for (const std::string& k : {key, under}) {
      if (line.compare(b, k.size(), k) != 0) continue;
      const size_t e = line.find_first_not_of(" \t", b + k.size());
      if (e != std::string::npos && line[e] == '=') return true;
    }
  }
  return false;
}

// CLI11's errors about an option's value ("--steps: At Most 1 required but received 2") do not
// say that the value came from the --config file (30th hostile pass): where the option is not on
// the command line, say so.
std::string from_config_note(const std::string& what, int argc, char** argv) {
  const std::string path = config_path(argc, argv);
  const size_t at = what.find("--");
  if (path.empty() || at == std::string::npos) return "";
  size_t end = at + 2;
  while (end < what.size() &&
         (std::isalnum(static_cast<unsigned char>(what[end])) != 0 || what[end] == '-')) {
    end++;
  }
  const std::string name = what.substr(at, end - at);
  if (name.size() <= 2 || what.find(" is required") != std::string::npos) return "";
  for (int i = 1; i < argc; i++) {
    const std::string a = argv[i];
    if (a == name || a.rfind(name + "=", 0) == 0) return "";  // (given on the command line)
  }
  if (!config_sets(path, name.substr(2))) return "";  // (e.g. given by a short name: -n)
  const bool form = what.find("At Most") != std::string::npos ||
                    what.find("Could not convert") != std::string::npos;
  return " (set in the --config file '" + path + "' as " + name.substr(2) + " = ..." +
         (form ? ": one value, a number or quoted text, with no comment after it)" : ")");
}

int run_main(int argc, char** argv) {
  tune_openmp_wait(argv);
  name_process(argc > 0 ? argv[0] : nullptr);
  // Past a file-size limit (ulimit -f) a write fails with EFBIG, which the checked writers turn
  // into an error naming the file (a partial file is removed, saved ones are kept), instead of
  // SIGXFSZ killing the process mid-save.
  std::signal(SIGXFSZ, SIG_IGN);
  attnres::cli::start_signal_thread();  // before any other thread exists
  attnres::cli::set_command_line(argc, argv);
  CLI::App app{
      "attnres: a C++ engine that trains and runs Transformer language models with Attention "
      "Residuals.\nRun `attnres <command> --help` for a command's options."};
  app.require_subcommand(1);
  int threads = 0;
  app.add_option("--threads", threads, "Threads for compute (0 = all cores)")
      ->check(CLI::Range(0, kMaxThreads));
  app.set_config("--config", "", "Read options from a TOML/INI file (command-line flags win)");
  app.config_formatter(std::make_shared<StrictFlagConfig>());
  // A key of the config file that names no option (a typo, a misspelt [section]) is an error,
  // not silently ignored.
  app.allow_config_extras(CLI::config_extras_mode::error);
  app.set_version_flag(
      "--version", std::function<std::string()>([] {
        std::string why;
        const int gpus = attnres::cuda::device_count(&why);
        return std::string("attnres ") + ATTNRES_VERSION + "\n  multi-process training (MPI): " +
               (attnres::dist::mpi_compiled() ? "yes" : "no (built without MPI)") + "\n  CUDA: " +
               (gpus > 0 ? std::to_string(gpus) + " GPU(s); " + attnres::cuda::describe_device()
                         : why) +
               "\n  devices (--device): cpu, cuda-host" + (gpus > 0 ? ", cuda" : "") +
               "\n  CPU kernels: " +
#ifdef ATTNRES_RUNTIME_DISPATCH
               "portable build, the best of AVX-512/AVX2/baseline chosen at run time";
#else
               "built for the build machine's CPU (-march=native)";
#endif
      }),
      "Print the version and what this build supports (MPI, CUDA), then exit");
  app.parse_complete_callback([&] {
    attnres::cli::set_requested_threads(threads);
    const int ranks = attnres::dist::launched_world_size();
    if (ranks > 1 && !app.got_subcommand("train")) {
      throw attnres::Error("this process is one of " + std::to_string(ranks) +
                           " ranks started by mpirun, but only `attnres train` runs on several "
                           "ranks (the ranks would each do the whole job and overwrite each "
                           "other's files); run this command without mpirun");
    }
    if (threads > 0) omp_set_num_threads(threads);
    // (4096 threads on 2 cores ran 300 times slower without a word; twenty-first hostile pass)
    if (const int cores = omp_get_num_procs(); threads > cores) {
      std::fprintf(stderr,
                   "note: --threads %d is more than the %d cores this process may use: the "
                   "threads will take turns, which is slower than --threads %d\n",
                   threads, cores, cores);
    }
    use_every_requested_thread();
    if (!g_config_sections.empty() && !g_config_sections.count("")) {
      for (const CLI::App* sub : app.get_subcommands()) {
        if (!g_config_sections.count(sub->get_name())) {
          std::fprintf(stderr,
                       "note: the --config file '%s' has no [%s] section: nothing in it applies "
                       "to `attnres %s`\n",
                       g_config_path.c_str(), sub->get_name().c_str(), sub->get_name().c_str());
        }
      }
    }
    for (const char* prints : {"eval", "generate", "info", "inspect", "bench", "report"}) {
      g_output_is_the_product |= app.got_subcommand(prints);
    }
    // A command that runs a model has oneDNN generate its GEMM kernels before anything large is
    // allocated (see prepare_gemm).
    for (const char* computes :
         {"train", "eval", "generate", "inspect", "bench", "compare", "scale", "import-hf"}) {
      if (app.got_subcommand(computes)) attnres::prepare_gemm();
    }
  });
  attnres::cli::add_train(app);
  attnres::cli::add_eval(app);
  attnres::cli::add_generate(app);
  attnres::cli::add_info(app);
  attnres::cli::add_inspect(app);
  attnres::cli::add_compare(app);
  attnres::cli::add_report(app);
  attnres::cli::add_scale(app);
  attnres::cli::add_bench(app);
  attnres::cli::add_import_hf(app);
  attnres::cli::add_export_hf(app);
  decimal_integers(app);
  no_empty_values(app);
  // An unknown command word is an error even with --help (CLI11 would print the main help and
  // exit 0, or say only "A subcommand is required").
  for (int i = 1; i < argc; i++) {
    const std::string a = argv[i];
    if (a == "--threads" || a == "--config") {
      i++;
      continue;
    }
    if (a.empty() || a[0] == '-') continue;
    const CLI::App& top = app;
    const auto subs = top.get_subcommands(std::function<bool(const CLI::App*)>());
    std::string names;
    bool known = false;
    for (const CLI::App* s : subs) {
      names += " " + s->get_name();
      known |= s->get_name() == a;
    }
    if (known) break;
    std::fprintf(stderr, "error: unknown command '%s'; the commands are:%s (attnres --help)\n",
                 a.c_str(), names.c_str());
    return 2;
  }
  try {
    check_inputs_before_parsing(argc, argv);
    // `--prompt=` is an empty prompt: CLI11 would take the next argument as its value
    // (`--prompt= -n3` generated from the prompt "-n3"; seventeenth hostile pass).
    std::vector<std::string> args(argv + 1, argv + argc);
    for (size_t i = 0; i < args.size(); i++) {
      if (args[i] == "--prompt=" && (i == 0 || args[i - 1] != "--prompt")) {
        args[i] = "--prompt";
        args.insert(args.begin() + static_cast<std::ptrdiff_t>(i) + 1, std::string());
      }
    }
    std::reverse(args.begin(), args.end());  // (CLI11 takes a vector last argument first)
    app.name(argv[0]);                       // (as parse(argc, argv) would: the usage line)
    app.parse(args);
  } catch (const CLI::ConfigError& e) {
    // (CLI11's "INI was not able to parse train.stepz" named neither the file nor the fix:
    // sixteenth hostile pass)
    const std::string path = config_path(argc, argv);
    std::fprintf(stderr,
                 "error: the --config file '%s': %s. Its keys are options' long names without "
                 "'--', under the section of their command (e.g. [train] then steps = 100; "
                 "`attnres train --help` lists them)\n",
                 path.c_str(), e.what());
    return e.get_exit_code();
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    // A command that stopped on a signal (compare, scale) has said so and how to continue: its
    // exit code alone (CLI11 added "error: Runtime error"; eighteenth hostile pass).
    if (dynamic_cast<const CLI::RuntimeError*>(&e) && e.get_exit_code() == 130) return 130;
    // One `error:` line as every other refusal, and where a global option came after the
    // command, where it goes (CLI11 said only "The following arguments were not expected:
    // 0 --threads"; seventeenth hostile pass).
    std::string hint;
    const std::string what = e.what();
    for (const char* global : {"--threads", "--config"}) {
      if (what.find("not expected") != std::string::npos &&
          what.find(global) != std::string::npos) {
        hint = std::string("; ") + global + " is an option of attnres itself: give it before " +
               "the command (attnres " + global + " ... train ...)";
      }
    }
    if (hint.empty()) hint = from_config_note(what, argc, argv);
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s%s\nRun with --help for more information.\n", what.c_str(),
                 hint.c_str());
    return e.get_exit_code();
  } catch (...) {
    return report_exception();
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  open_standard_fds();
  install_sigbus_handler();
  int code = 0;
  try {
    code = run_main(argc, argv);
  } catch (...) {  // setting up the commands failed (e.g. out of memory, no thread)
    code = report_exception();
  }
  return check_output_written(code);
}
