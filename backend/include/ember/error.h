// ember::Error is what every stage throws for input it cannot handle: bad IR text, an op the
// dispatcher does not know, a corrupt package. Python sees it as ember.EmberError.
#pragma once

#include <stdexcept>
#include <string>

namespace ember {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace ember
