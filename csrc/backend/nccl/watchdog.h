// The watchdog of a group's CUDA operations: NCCL kernels run on their own, so no thread of
// ours waits inside them. This thread looks at every operation in flight a few times a
// second: one whose end event has passed is finished (and lets go of its tensors); one past
// the group's timeout, or whose communicator reports an asynchronous error
// (ncclCommGetAsyncError: a peer died, a network failure), fails the group. Then every
// communicator is aborted (ncclCommAbort stops the kernels still waiting for a peer, so the
// GPU does not hang either) and every operation in flight fails with that first error.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend/nccl/nccl_work.h"

namespace torchpar {

class Watchdog {
 public:
  // `on_failure` runs once, on the watchdog's thread, with the first error (the backend
  // aborts its communicators there).
  Watchdog(std::string group, int rank, int size, std::function<void(std::exception_ptr)> on_failure);
  ~Watchdog() { stop(); }

  void add(c10::intrusive_ptr<NcclWork> work);
  // Fails every operation still in flight with `error` (the group has failed elsewhere).
  void fail_all(std::exception_ptr error);
  // Returns once no operation is in flight (each finishes, or fails at its timeout).
  void drain();
  // Ends the thread; operations still in flight stay as they are.
  void stop();

 private:
  void run();
  // The error an operation fails the group with, or null while it is healthy.
  std::exception_ptr check(NcclWork& work, nccl::Clock::time_point now);

  const std::string group_;
  const int rank_, size_;
  std::function<void(std::exception_ptr)> on_failure_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<c10::intrusive_ptr<NcclWork>> works_;
  // Failed operations whose kernels may still be queued on the GPU: held (and their tensors
  // with them) until their end events pass.
  std::vector<c10::intrusive_ptr<NcclWork>> failed_works_;
  bool stopping_ = false;
  std::exception_ptr failure_;  // the first error, once the group has failed
  std::thread thread_;
};

}  // namespace torchpar
