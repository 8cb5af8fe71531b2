// The attnres CLI's subcommands. Each add_* registers its options and the callback that runs it.
#pragma once

#include <CLI/CLI.hpp>

namespace attnres::cli {

void add_train(CLI::App& app);
void add_eval(CLI::App& app);
void add_generate(CLI::App& app);
void add_info(CLI::App& app);
void add_inspect(CLI::App& app);
void add_compare(CLI::App& app);
void add_report(CLI::App& app);
void add_bench(CLI::App& app);
void add_scale(CLI::App& app);
void add_import_hf(CLI::App& app);
void add_export_hf(CLI::App& app);

// The global --threads option (0 = not given).
int requested_threads();

// The command line as typed (for reports).
const std::string& command_line();
void set_command_line(int argc, char** argv);

// The default corpus: Debian's `fortunes` package (installed by scripts/setup.sh).
inline const char* kDefaultCorpus = "/usr/share/games/fortunes";

}  // namespace attnres::cli
