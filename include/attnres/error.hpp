// attnres/error.hpp — the error type the library throws (and its one refinement).
//
// Library code never prints or exits: it throws attnres::Error with a message that names the file
// or value at fault and how to fix it. Only the CLI (src/cli) catches, prints and chooses the exit
// code.
#pragma once

#include <stdexcept>
#include <string>

namespace attnres {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Training stopped because it diverged (too many non-finite steps, or a non-finite evaluation).
// A distinct type so that `compare` can record such a run as diverged and go on with the others.
class DivergedError : public Error {
 public:
  explicit DivergedError(const std::string& what) : Error(what) {}
};

// An allocation of `bytes` for `what` failed (std::bad_alloc): the Error that says what and how
// big it was, and what to lower (`fix`).
Error out_of_memory(const std::string& what, double bytes, const std::string& fix);

// What went wrong, for a message that wraps a caught exception: its what(), or "out of memory"
// for std::bad_alloc (whose what() is only "std::bad_alloc").
std::string cause_of(const std::exception& e);

// `s` as one word of a shell command that a message suggests: as it is when it holds only
// characters no shell treats specially, else in single quotes (a --out named 'x;touch y' ran
// `touch y` when the printed resume command was pasted; twenty-second hostile pass).
std::string shell_word(const std::string& s);

// Throws Error(msg) when cond is false. For checks on user input, not internal invariants.
inline void check(bool cond, const std::string& msg) {
  if (!cond) throw Error(msg);
}

}  // namespace attnres
