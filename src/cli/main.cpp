// attnres: train, evaluate and sample Transformer language models with Attention Residuals.
// The only place that prints errors and picks exit codes (library code throws attnres::Error).
#include <omp.h>

#include <cstdio>
#include <exception>

#include "attnres/error.hpp"
#include "cli/commands.hpp"

int main(int argc, char** argv) {
  CLI::App app{
      "attnres: a C++ engine that trains and runs Transformer language models with Attention "
      "Residuals.\nRun `attnres <command> --help` for a command's options."};
  app.require_subcommand(1);
  int threads = 0;
  app.add_option("--threads", threads, "Threads for compute (0 = all cores)")
      ->check(CLI::NonNegativeNumber);
  app.set_config("--config", "", "Read options from a TOML/INI file (command-line flags win)");
  app.parse_complete_callback([&] {
    if (threads > 0) omp_set_num_threads(threads);
  });
  attnres::cli::add_train(app);
  attnres::cli::add_eval(app);
  attnres::cli::add_generate(app);
  attnres::cli::add_info(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const attnres::Error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "\nerror: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "\ninternal error: %s\n(please report this with the command you ran)\n",
                 e.what());
    return 2;
  }
  return 0;
}
