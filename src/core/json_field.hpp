// Typed reads of JSON fields from files (checkpoint configs, train_config.json) that reject what a
// plain nlohmann get<T>() would convert silently or with undefined behaviour: a float such as 1e300
// into an integer (UB), a negative number into an unsigned, or a value out of the field's range.
#pragma once

#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "attnres/error.hpp"

namespace attnres {

// Nesting deeper than this in a file from outside is refused: nlohmann's dump() and the engine's
// walks recurse, and 200k levels (a 400 KB file) overflowed the stack.
constexpr int kMaxJsonDepth = 64;

// A SAX pass over JSON text that keeps nothing: it checks the nesting depth, and (with
// `unique_keys`) that no object names a key twice (a parser keeps the last of duplicates
// silently). Linear: nlohmann's DOM parser with a callback rescans a parent's members at the end
// of each child, which made a header of 40k entries take 10 s.
class JsonShapeCheck : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit JsonShapeCheck(bool unique_keys) : unique_keys_(unique_keys) {}
  bool too_deep = false;
  std::string duplicate;  // the first key found twice in one object

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    keys_.emplace_back();
    return enter();
  }
  bool key(string_t& k) override {
    if (unique_keys_ && !keys_.empty() && !keys_.back().insert(k).second) {
      duplicate = k;
      return false;
    }
    return true;
  }
  bool end_object() override {
    keys_.pop_back();
    depth_--;
    return true;
  }
  bool start_array(std::size_t) override { return enter(); }
  bool end_array() override {
    depth_--;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;  // (the DOM parse that follows reports it)
  }

 private:
  bool enter() {
    too_deep = ++depth_ > kMaxJsonDepth;
    return !too_deep;
  }
  bool unique_keys_;
  int depth_ = 0;
  std::vector<std::set<std::string>> keys_;
};

// nlohmann::json::parse(text) for text from files: also throws nlohmann::json::exception (which
// callers turn into an Error naming the file) for nesting deeper than kMaxJsonDepth.
inline nlohmann::json parse_json(std::string_view text) {
  JsonShapeCheck shape(false);
  nlohmann::json::sax_parse(text, &shape);
  if (shape.too_deep) {
    throw nlohmann::json::out_of_range::create(
        406, "JSON nested deeper than " + std::to_string(kMaxJsonDepth) + " levels", nullptr);
  }
  return nlohmann::json::parse(text);
}

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
