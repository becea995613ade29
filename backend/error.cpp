// ember::exception_handled (ember/error.h): the Python bindings' hook, where they are loaded.
#include "ember/error.h"

#include <atomic>

namespace ember {
namespace {
std::atomic<void (*)(std::exception_ptr)> g_handled{nullptr};
}  // namespace

void set_exception_handled(void (*handled)(std::exception_ptr)) { g_handled.store(handled, std::memory_order_release); }

void exception_handled() {
  if (auto* handled = g_handled.load(std::memory_order_acquire)) handled(std::current_exception());
}

}  // namespace ember
