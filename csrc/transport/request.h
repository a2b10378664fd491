// One posted point-to-point operation. The progress thread completes it; any thread may
// wait on it. One mutex, one condition variable, one stored exception.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>

namespace torchpar {

using Clock = std::chrono::steady_clock;

// A point-to-point progress thread finishes requests, and so runs the callbacks users chain
// on their futures. Such a callback must not block on another operation: only this thread
// could finish it (issue 21). The thread marks itself, and every blocking wait of ours
// called on it throws this error naming `what` instead of hanging.
void mark_progress_thread();
void check_not_on_progress_thread(const char* what);

class Request {
 public:
  enum class Kind { kSend, kRecv };

  Request(Kind kind, int peer, uint64_t tag, void* data, size_t bytes, Clock::time_point deadline)
      : kind(kind), peer(peer), tag(tag), data(data), bytes(bytes), deadline(deadline) {}

  const Kind kind;
  const int peer;      // -1: a receive from any source
  const uint64_t tag;
  void* const data;
  const size_t bytes;
  const Clock::time_point deadline;

  bool done() const;
  // Waits until done or until `timeout` passes; returns done(). Never throws.
  bool wait_for(std::chrono::milliseconds timeout);
  // Waits until done; rethrows the request's error.
  void wait();
  std::exception_ptr error() const;
  // The rank the data came from (receives; the peer for sends).
  int source() const;

  // Runs `fn` once when the request finishes (at once if it already has).
  void on_done(std::function<void()> fn);

  // Called by the progress thread, exactly once.
  void complete(int source);
  void fail(std::exception_ptr error);

 private:
  void finish(std::unique_lock<std::mutex>& lock);

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  int source_ = -1;
  std::exception_ptr error_;
  std::function<void()> on_done_;
};

}  // namespace torchpar
