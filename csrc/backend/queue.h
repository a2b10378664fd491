// The collectives of one group, run one at a time in the order they were issued: every rank
// must execute them in the same order. A worker thread runs what async_op=True queued; a
// blocking call finding the queue idle runs on the calling thread instead, sparing two
// thread hand-offs. A failure that breaks the group (anything but bad input every rank saw
// alike) fails that collective and every later one at once, with the first error.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend/work.h"
#include "collectives/comm.h"
#include "common/env.h"
#include "transport/transport.h"

namespace torchpar {

class CollectiveQueue {
 public:
  using Task = std::function<void(collectives::Comm&)>;

  CollectiveQueue(Transport& transport, const Config& config, int rank, int size, std::string group_name);
  ~CollectiveQueue() { stop(); }

  // Runs `task` in its turn and completes `work` with its outcome. Throws at once if the
  // queue has been stopped.
  void submit(c10::intrusive_ptr<Work> work, const char* name, Task task, std::chrono::milliseconds timeout,
              bool async_op);
  // Runs what was already queued, then ends the worker (idempotent).
  void stop();
  // Whether this thread is running one of this queue's operations now (its worker, or a caller
  // running one inline): a future callback is, between its operation and the next one.
  bool running_on_this_thread() const;
  // For such a thread (a callback waiting on an operation queued before it ran): runs what is
  // queued, here and in order, since nobody else runs the queue until the callback returns;
  // stops once `until` has completed.
  void run_queued_here(const Work* until);

 private:
  struct Queued {
    c10::intrusive_ptr<Work> work;
    const char* name;
    Task task;
    std::chrono::milliseconds timeout;
    uint64_t issue = 0;  // its place in the order of issue (issued_ before it)
  };

  void run_worker();
  // Runs a collective; `caller_blocks` when the caller is waiting for it (inline execution).
  void execute(Queued& item, bool caller_blocks);
  // Runs the front of the queue if it was issued before `issue`; whether it ran one.
  bool run_front_issued_before(uint64_t issue);
  // Completes the item's work with `error` (null: success), never throwing.
  void finish(Queued& item, std::exception_ptr error);
  // " [rank 3's collectives before it: #1690 all_reduce, ...]", for a failure of collective
  // `seq`: two ranks' messages side by side show where their programs parted (one ran a
  // collective the other did not). Names the rank: a peer's message quotes this one.
  std::string recent_collectives(uint64_t seq) const;

  Transport& transport_;
  const Config& config_;
  const int rank_, size_;
  const std::string group_name_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Queued> queue_;
  // Collectives issued so far (by any thread), shared with their works (Work::getFuture).
  std::shared_ptr<std::atomic<uint64_t>> issued_ = std::make_shared<std::atomic<uint64_t>>(0);
  bool stopping_ = false;
  bool busy_ = false;               // a collective is running (on the worker or inline)
  uint64_t next_seq_ = 0;           // only the thread running a collective (busy_) touches it
  std::array<const char*, 6> recent_{};  // the same; names of the last collectives, by seq % size
  std::vector<char> scratch_;       // the same; staging of the point-to-point collectives
  std::exception_ptr group_error_;  // first fatal error; guarded by mu_
  std::thread worker_;
};

}  // namespace torchpar
