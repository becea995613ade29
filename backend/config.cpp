#include "ember/config.h"

#include <cstring>
#include <map>
#include <mutex>

extern char** environ;

namespace ember {
namespace {

struct Settings {
  std::mutex mu;
  std::map<std::string, std::optional<std::string>> values;  // only EMBER_* names

  Settings() {
    for (char** e = environ; e && *e; ++e) {
      if (std::strncmp(*e, "EMBER_", 6) != 0) continue;
      const char* eq = std::strchr(*e, '=');
      if (eq) values[std::string(*e, static_cast<size_t>(eq - *e))] = std::string(eq + 1);
    }
  }
};

Settings& settings() {
  static Settings s;  // the environment, read once
  return s;
}

}  // namespace

std::optional<std::string> config_value(const std::string& name) {
  Settings& s = settings();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.values.find(name);
  return it == s.values.end() ? std::nullopt : it->second;
}

void config_set(const std::string& name, const std::optional<std::string>& value) {
  Settings& s = settings();
  std::lock_guard<std::mutex> lock(s.mu);
  s.values[name] = value;
}

}  // namespace ember
