// Fuzzes the configuration parsers: the model config JSON stored in checkpoints, the run's
// train_config.json (read on --resume) and the TOML file of `attnres --config FILE train`.
#include <CLI/CLI.hpp>
#include <cstdlib>
#include <sstream>

#include "attnres/config.hpp"
#include "attnres/error.hpp"
#include "attnres/train.hpp"
#include "cli/train_options.hpp"

using namespace attnres;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);

  // Checkpoint metadata "config": a valid config must survive its own JSON round trip.
  try {
    ModelConfig c = ModelConfig::from_json(text);
    c.resolve();
    c.validate();
    const std::string j = c.to_json();
    if (ModelConfig::from_json(j).to_json() != j) std::abort();
  } catch (const Error&) {
  }

  // train_config.json, as --resume reads it.
  try {
    TrainConfig t = TrainConfig::from_json(text);
    t.validate();
    t.model.resolve();
    t.model.validate();
    const std::string j = t.to_json();
    if (TrainConfig::from_json(j).to_json() != j) std::abort();
  } catch (const Error&) {
  }

  // The TOML/INI config file, through the same option table as the CLI.
  try {
    cli::TrainArgs a;
    CLI::App app;
    app.set_config("--config");
    CLI::App* train = app.add_subcommand("train");
    cli::add_train_options(train, a);
    train->add_option("--out", a.cfg.out_dir);
    train->add_flag("--resume", a.cfg.resume);
    std::istringstream in(text);
    app.parse_from_stream(in);
    a.finalize();
    a.cfg.validate();
    a.cfg.model.resolve();
    a.cfg.model.validate();
  } catch (const CLI::Error&) {
  } catch (const Error&) {
  }
  return 0;
}
