// attnres: train, evaluate and sample Transformer language models with Attention Residuals.
// The only place that prints errors and picks exit codes (library code throws attnres::Error).
#include <fcntl.h>
#include <omp.h>
#include <unistd.h>

#include <cctype>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <functional>
#include <new>
#include <string>
#include <system_error>

#include "attnres/cuda.hpp"
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

constexpr int kMaxThreads = 4096;  // far above any machine's cores; libgomp dies at 65536
constexpr int64_t kMaxConfigBytes = 1 << 20;  // a --config file

// Checks what CLI11 cannot before it reads anything: the --config file is a regular file of at
// most 1 MiB (a FIFO would block it, /dev/zero would never end), and OMP_NUM_THREADS is in range.
void check_inputs_before_parsing(int argc, char** argv) {
  for (int i = 1; i < argc; i++) {
    const std::string a = argv[i];
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
                 "--n-layer (or raise ulimit -v). Checkpoints already saved are intact.\n");
    return 1;
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
    std::fprintf(stderr, "\ninternal error: %s\n(please report this with the command you ran)\n",
                 e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "\ninternal error: %s\n(please report this with the command you ran)\n",
                 e.what());
    return 2;
  }
}

int run_main(int argc, char** argv) {
  tune_openmp_wait(argv);
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
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (...) {
    return report_exception();
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run_main(argc, argv);
  } catch (...) {  // setting up the commands failed (e.g. out of memory, no thread)
    return report_exception();
  }
}
