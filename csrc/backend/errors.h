// Turning the transport's and collectives' errors (common/error.h) into what torch raises:
// torch.distributed.DistBackendError, naming the operation, rank, group and collective.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>

namespace torchpar {

// The message of a stored exception (c10 errors without their C++ backtrace).
std::string message_of(std::exception_ptr error);

// A c10::DistBackendError (torch.distributed.DistBackendError in Python) with `msg`.
std::exception_ptr dist_backend_error(std::string msg);

// Where a collective failed, for its message.
struct FailureContext {
  const char* op;
  int rank;
  int size;
  std::string group;
  uint64_t seq;
  std::chrono::milliseconds timeout;
};

// The error a failed collective completes with, and whether it ends the group (`*fatal`):
// bad input that every rank saw alike (UsageError) leaves the group usable; anything else
// does not. For a lost peer, `abort_reason()` says why that peer gave up ("" if unknown).
std::exception_ptr describe_failure(const FailureContext& where, std::exception_ptr error, bool* fatal,
                                    const std::function<std::string()>& abort_reason);

}  // namespace torchpar
