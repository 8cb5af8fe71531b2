// An option whose value is one of an enum's names: CLI11 checks the name against `names`, and it
// is parsed into the enum once, here at the edge (the library never compares option strings).
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <utility>
#include <vector>

namespace attnres::cli {

// Registers `flag` on s, bound to field (parsed by parse, shown by to_string(field)).
template <class E, class Parse>
CLI::Option* add_enum_option(CLI::App* s, const std::string& flag, E& field, Parse parse,
                             const std::string& help, std::vector<std::string> names) {
  return s
      ->add_option_function<std::string>(
          flag, [&field, parse](const std::string& v) { field = parse(v); }, help)
      ->check(CLI::IsMember(std::move(names)))
      ->type_name("TEXT")
      ->default_str(to_string(field));
}

}  // namespace attnres::cli
