#include "backend/nccl/watchdog.h"

#include <algorithm>

#include "backend/errors.h"
#include "common/error.h"

namespace torchpar {

namespace {
// How often in-flight operations are looked at: the delay with which a finished one lets go
// of its tensors, and a timeout or asynchronous error is noticed.
constexpr auto kPollInterval = std::chrono::milliseconds(20);
}  // namespace

Watchdog::Watchdog(std::string group, int rank, int size, std::function<void(std::exception_ptr)> on_failure)
    : group_(std::move(group)), rank_(rank), size_(size), on_failure_(std::move(on_failure)) {
  thread_ = std::thread([this] { run(); });
}

void Watchdog::add(c10::intrusive_ptr<NcclWork> work) {
  std::exception_ptr failure;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_) {
      works_.push_back(std::move(work));
      return;
    }
    failure = failure_;
    failed_works_.push_back(work);
  }
  work->fail(failure);  // enqueued while the group failed: it fails too (outside the lock:
                        // failing completes its future, whose callbacks may call us)
}

void Watchdog::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Watchdog::drain() {
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (works_.empty() || failure_ || stopping_ || !thread_.joinable()) return;
    }
    std::this_thread::sleep_for(kPollInterval);
  }
}

void Watchdog::fail_all(std::exception_ptr error) {
  std::vector<c10::intrusive_ptr<NcclWork>> works;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_) failure_ = error;
    works.swap(works_);
    failed_works_.insert(failed_works_.end(), works.begin(), works.end());
  }
  for (auto& w : works) w->fail(error);  // outside the lock, as in add()
}

std::exception_ptr Watchdog::check(NcclWork& work, nccl::Clock::time_point now) {
  FailureContext where{work.name().c_str(), rank_, size_, group_, work.seq(), work.timeout()};
  bool fatal = true;
  try {
    ncclResult_t state = work.comm()->async_error();
    if (state != ncclSuccess && state != ncclInProgress) {
      TP_THROW("NCCL reported an asynchronous error on communicator ", work.comm()->key(), ": ",
               work.comm()->describe(state));
    }
    if (work.past_deadline(now)) {
      TP_THROW_TIMEOUT("the operation did not finish on the GPU (a peer that never joined it, or died)");
    }
    return nullptr;
  } catch (...) {
    return describe_failure(where, std::current_exception(), &fatal, [] { return std::string(); });
  }
}

void Watchdog::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    cv_.wait_for(lock, kPollInterval, [this] { return stopping_; });
    if (stopping_) break;
    // Failed operations go once the GPU is done with them (the aborted kernels exit).
    failed_works_.erase(std::remove_if(failed_works_.begin(), failed_works_.end(),
                                       [](const auto& w) {
                                         try {
                                           return w->gpu_done();
                                         } catch (...) {
                                           return true;  // the device is in trouble: nothing more to wait for
                                         }
                                       }),
                        failed_works_.end());
    if (works_.empty() || failure_) continue;
    std::vector<c10::intrusive_ptr<NcclWork>> works = works_;
    lock.unlock();
    std::exception_ptr error;
    const auto now = nccl::Clock::now();
    for (auto& w : works) {
      try {
        if (w->poll()) continue;
        error = check(*w, now);
      } catch (...) {  // a CUDA error from the event query: the device is in trouble
        FailureContext where{w->name().c_str(), rank_, size_, group_, w->seq(), w->timeout()};
        bool fatal = true;
        error = describe_failure(where, std::current_exception(), &fatal, [] { return std::string(); });
      }
      if (error) break;
    }
    if (error) {
      on_failure_(error);  // aborts the communicators: the kernels in flight stop
      fail_all(error);
    }
    lock.lock();
    // Finished operations leave the list (those added meanwhile stay).
    works_.erase(std::remove_if(works_.begin(), works_.end(),
                                [](const auto& w) {
                                  try {
                                    return w->isCompleted();
                                  } catch (...) {
                                    return false;  // looked at again next round, under check()
                                  }
                                }),
                 works_.end());
  }
}

}  // namespace torchpar
