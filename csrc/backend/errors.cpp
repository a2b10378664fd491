#include "backend/errors.h"

#include <c10/util/Exception.h>

#include "common/error.h"

namespace torchpar {

std::string message_of(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

std::exception_ptr dist_backend_error(std::string msg) {
  return std::make_exception_ptr(c10::DistBackendError(
      c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, std::move(msg)));
}

std::exception_ptr describe_failure(const FailureContext& where, std::exception_ptr error, bool* fatal,
                                    const std::function<std::string()>& abort_reason) {
  *fatal = true;
  std::string what = message_of(error);
  try {
    std::rethrow_exception(error);
  } catch (const UsageError&) {
    *fatal = false;  // every rank saw the same thing and stopped in step
  } catch (const PeerLostError&) {
    // A peer that gave up on the group hangs up after saying why (over TCP, in the store).
    std::string why = abort_reason();
    if (!why.empty()) what = why;
  } catch (const TimeoutError&) {
    // " Timed out " is the shape gloo's message has, and what users and PyTorch's tests match.
    what = "Timed out after " + std::to_string(where.timeout.count()) + " ms: " + what;
  } catch (...) {
  }
  std::string msg = std::string("torchpar ") + where.op + " failed on rank " + std::to_string(where.rank) + "/" +
                    std::to_string(where.size) + " of group '" + where.group + "' (collective #" +
                    std::to_string(where.seq) + "): " + what;
  if (*fatal) msg += " [the group is no longer usable]";
  return dist_backend_error(std::move(msg));
}

}  // namespace torchpar
