// Errors with context. Plain C++17 so the transport and collectives layers can use it
// without torch headers; the backend turns these into torch.distributed.DistBackendError.
#pragma once

#include <cerrno>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

namespace torchpar {

// Any failure of a communication operation: bad input, mismatch across ranks, dead peer.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad arguments, or arguments that disagree across ranks. Raised while the ranks are still
// in step, so the group stays usable afterwards.
class UsageError : public Error {
 public:
  using Error::Error;
};

// A peer's process is gone, or the connection to it (the group cannot go on).
class PeerLostError : public Error {
 public:
  using Error::Error;
};

// A wait ran past the group's timeout.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

namespace detail {

inline void append(std::ostringstream&) {}

template <typename T, typename... Rest>
void append(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  append(os, rest...);
}

template <typename... Args>
std::string message(const char* file, int line, const Args&... args) {
  std::ostringstream os;
  const char* base = file;
  for (const char* p = file; *p; ++p) {
    if (*p == '/') base = p + 1;
  }
  os << "[torchpar " << base << ":" << line << "] ";
  append(os, args...);
  return os.str();
}

}  // namespace detail
}  // namespace torchpar

// TP_CHECK(cond, "what", value, "...") throws torchpar::Error with [file:line] and the message.
#define TP_CHECK(cond, ...)                                                          \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      throw ::torchpar::Error(::torchpar::detail::message(__FILE__, __LINE__, __VA_ARGS__)); \
    }                                                                                \
  } while (0)

// Like TP_CHECK, for a UsageError (the group stays usable).
#define TP_CHECK_USAGE(cond, ...)                                                        \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      throw ::torchpar::UsageError(::torchpar::detail::message(__FILE__, __LINE__, __VA_ARGS__)); \
    }                                                                                    \
  } while (0)

#define TP_THROW(...) \
  throw ::torchpar::Error(::torchpar::detail::message(__FILE__, __LINE__, __VA_ARGS__))

#define TP_THROW_TIMEOUT(...) \
  throw ::torchpar::TimeoutError(::torchpar::detail::message(__FILE__, __LINE__, __VA_ARGS__))

// For system calls: appends strerror(errno).
#define TP_CHECK_ERRNO(cond, ...)                                                     \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      int tp_errno_ = errno;                                                          \
      throw ::torchpar::Error(::torchpar::detail::message(__FILE__, __LINE__, __VA_ARGS__, \
                                                         ": ", std::strerror(tp_errno_))); \
    }                                                                                 \
  } while (0)
