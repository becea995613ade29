// ember::Error is what every stage throws for input it cannot handle: bad IR text, an op the
// dispatcher does not know, a corrupt package. Python sees it as ember.EmberError.
#pragma once

#include <exception>
#include <stdexcept>
#include <string>

namespace ember {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Called in a catch block where ember handles a failed ATen call itself (a library path that refuses the
// problem, a timed candidate that cannot run) and goes on another way. An ATen call can reach Python (a
// TorchDispatchMode such as AOTAutograd's first-call alias check, a Python kernel), and torch reports an error
// there as a C++ exception with Python's error indicator still set: left so, the next Python function to return
// fails with "SystemError: ... returned a result with an exception set" (fuzz seed 1920463: a bfloat16 CPU
// convolution that torch's oneDNN path refuses on a CPU without AVX-512). The Python bindings register how to
// clear it (set_exception_handled); a program without Python has nothing to clear.
void exception_handled();
void set_exception_handled(void (*handled)(std::exception_ptr));

}  // namespace ember
