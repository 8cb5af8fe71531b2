// Typed reads of JSON fields from files (checkpoint configs, train_config.json) that reject what a
// plain nlohmann get<T>() would convert silently or with undefined behaviour: a float such as 1e300
// into an integer (UB), a negative number into an unsigned, or a value out of the field's range.
#pragma once

#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>

#include "attnres/error.hpp"

namespace attnres {

// If `j` has `key`, stores it in dst and returns true (false: absent, dst unchanged); throws
// Error naming `what`, the key and the value if its type or range does not fit T.
template <class T>
bool read_json_field(const nlohmann::json& j, const char* key, T& dst, const std::string& what) {
  auto it = j.find(key);
  if (it == j.end()) return false;
  const nlohmann::json& v = *it;
  auto bad = [&](const char* expected) {
    throw Error(what + ": field '" + key + "' must be " + expected + ", got " +
                v.dump(-1, ' ', true) + "; the file is corrupt or was edited by hand");
  };
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) bad("true or false");
    dst = v.get<bool>();
  } else if constexpr (std::is_integral_v<T>) {
    if (!v.is_number_integer()) bad("an integer");
    if (v.is_number_unsigned()) {
      const auto u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<T>::max())) bad("an integer in range");
      dst = static_cast<T>(u);
    } else {
      const auto s = v.get<int64_t>();
      if constexpr (std::is_unsigned_v<T>) {
        if (s < 0) bad("a non-negative integer");
      } else {
        if (s < static_cast<int64_t>(std::numeric_limits<T>::min()) ||
            s > static_cast<int64_t>(std::numeric_limits<T>::max())) {
          bad("an integer in range");
        }
      }
      dst = static_cast<T>(s);
    }
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!v.is_number()) bad("a number");
    dst = v.get<T>();
  } else {
    if (!v.is_string()) bad("a string");
    dst = v.get<std::string>();
  }
  return true;
}

}  // namespace attnres
