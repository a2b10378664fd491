#include "backend/queue.h"

#include <c10/util/Exception.h>

#include "backend/errors.h"

namespace torchpar {

CollectiveQueue::CollectiveQueue(Transport& transport, const Config& config, int rank, int size,
                                 std::string group_name)
    : transport_(transport), config_(config), rank_(rank), size_(size), group_name_(std::move(group_name)) {
  worker_ = std::thread([this] { run_worker(); });
}

void CollectiveQueue::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void CollectiveQueue::submit(c10::intrusive_ptr<Work> work, const char* name, Task task,
                             std::chrono::milliseconds timeout, bool async_op) {
  Queued item{std::move(work), name, std::move(task), timeout};
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(!stopping_, "torchpar ", name, ": group '", group_name_, "' has been shut down");
    if (async_op || busy_ || !queue_.empty()) {
      queue_.push_back(std::move(item));
      cv_.notify_all();
      return;
    }
    busy_ = true;
  }
  execute(item, /*caller_blocks=*/true);
  {
    std::lock_guard<std::mutex> lock(mu_);
    busy_ = false;
  }
  cv_.notify_all();
}

void CollectiveQueue::run_worker() {
  while (true) {
    Queued item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return (stopping_ || !queue_.empty()) && !busy_; });
      if (queue_.empty()) return;
      item = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    execute(item, /*caller_blocks=*/false);
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
    }
    cv_.notify_all();
  }
}

void CollectiveQueue::execute(Queued& item, bool caller_blocks) {
  uint64_t seq = next_seq_++;
  std::exception_ptr failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    failed = group_error_;
  }
  if (failed) {
    item.work->complete(failed);
    return;
  }
  std::exception_ptr error;
  try {
    collectives::Comm comm{transport_.arena(), transport_.p2p(), config_, Clock::now() + item.timeout, seq,
                           caller_blocks, &scratch_};
    item.task(comm);
  } catch (...) {
    bool fatal = false;
    error = describe_failure({item.name, rank_, size_, group_name_, seq, item.timeout}, std::current_exception(),
                             &fatal, [this] { return transport_.abort_reason(); });
    if (fatal) {
      transport_.abort(message_of(error));
      std::lock_guard<std::mutex> lock(mu_);
      if (!group_error_) group_error_ = error;
    }
  }
  item.work->complete(error);
}

}  // namespace torchpar
