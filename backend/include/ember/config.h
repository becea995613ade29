#pragma once

// ember's settings as C++ sees them: one string value per setting, named by its environment variable
// ("EMBER_GEMM_ROUTE"). Python's ember.config (python_bindings/ember/config.py) owns the settings: it parses
// and validates them, and pushes each C++-read value here (set_config in python_bindings/module.cpp) when its
// extension loads and whenever a setting changes. Without Python (a C++ program running a package through
// ember::load, the gtests) the values are the environment's, read once at the first lookup. This file and
// backend/config.cpp are the only C++ that reads the environment for ember's settings.
// docs/configuration.md lists every setting. Lookups are thread-safe; code that keeps a value in a static
// reads it once per process, and says so.

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
