#pragma once

// ember's settings as C++ sees them: one string value per environment variable name ("EMBER_GEMM_ROUTE").
// Each value starts as the environment's (read once, at the first lookup of any setting), so a C++ program
// that loads a package honours the variables; Python's ember.config replaces them (set_config in
// python_bindings/module.cpp) when a setting changes and at the first compile. docs/configuration.md lists
// every setting. Lookups are thread-safe; code that caches a value in a static reads it once, as before.

#include <optional>
#include <string>

namespace ember {

// The value of `name`: the one set last (config_set), else the environment's; nullopt where neither is.
std::optional<std::string> config_value(const std::string& name);

// Sets `name` to `value` for later lookups; nullopt makes it unset (as if the variable were absent).
void config_set(const std::string& name, const std::optional<std::string>& value);

// Whether `name` is set to exactly `value`.
inline bool config_is(const std::string& name, const char* value) {
  const std::optional<std::string> v = config_value(name);
  return v && *v == value;
}

}  // namespace ember
