#include "backend/work.h"

#include <ATen/core/jit_type.h>

#include <thread>
#include <utility>

#include "backend/queue.h"
#include "transport/request.h"

namespace torchpar {

Work::Work(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type, title),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

namespace {
thread_local const Work* completing = nullptr;
}  // namespace

const Work* Work::completing_here() { return completing; }

void Work::complete(std::exception_ptr error) {
  // The future first: whoever wait()s on the work may read the future's value next. Its
  // callbacks run inside, and a collective they issue finds its place from this work
  // (CollectiveQueue::submit).
  {
    const Work* outer = std::exchange(completing, this);
    struct Restore {
      const Work* outer;
      ~Restore() { completing = outer; }
    } restore{outer};
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
  }
  finish(error);
}

void Work::released_by_completer() {
  // Before the work is shared with its completing thread: a waiter reads it unlocked.
  releases_.front()->owed = true;
}

void Work::complete_and_release(c10::intrusive_ptr<Work> work, std::exception_ptr error) {
  std::shared_ptr<Release> release = work->releases_.front();
  TORCH_INTERNAL_ASSERT(release->owed, "complete_and_release on a work not marked released_by_completer");
  struct Drop {  // also when complete() throws
    c10::intrusive_ptr<Work>& work;
    Release& release;
    ~Drop() {
      work.reset();
      {
        std::lock_guard<std::mutex> lock(release.mu);
        release.dropped = true;
      }
      release.cv.notify_all();
    }
  } drop{work, *release};
  {
    std::lock_guard<std::mutex> lock(release->mu);
    release->completer = std::this_thread::get_id();
  }
  work->complete(error);
}

bool Work::wait(std::chrono::milliseconds timeout) {
  bool blocks = !isCompleted();
  if (blocks) check_not_on_progress_thread("wait() on a torchpar work");
  // A callback on an earlier operation of the same group, waiting on this one: the thread it runs
  // on is the one that would run this one, so it runs what is queued now (as a callback issuing
  // an operation does, queue.cpp). Otherwise the wait would never end (audit finding; gloo's
  // thread pool runs it).
  if (blocks && queue_ != nullptr && queue_->running_on_this_thread()) {
    queue_->run_queued_here(this);
    blocks = !isCompleted();
  }
  // A point-to-point work is counted while it blocks: its engine's progress thread polls for
  // transfers only then (P2PEngine::waiters).
  struct Waiting {
    std::atomic<int>* count;
    explicit Waiting(std::atomic<int>* n) : count(n) {
      if (count) count->fetch_add(1, std::memory_order_relaxed);
    }
    ~Waiting() {
      if (count) count->fetch_sub(1, std::memory_order_relaxed);
    }
  } waiting(blocks && waiters_ ? waiters_.get() : nullptr);
  // A work its completing thread lets go of is waited for until it has (complete_and_release):
  // one wake-up, after the drop, rather than one at completion and a second after it.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (const auto& r : releases_) {
    if (!r->owed) continue;
    std::unique_lock<std::mutex> lock(r->mu);
    // This thread is inside that completion (a callback waiting on a coalesced group that its
    // last part completed, review): it cannot wait for itself to return.
    if (r->completer == std::this_thread::get_id()) continue;
    auto dropped = [&] { return r->dropped; };
    if (timeout == ::kNoTimeout) {
      r->cv.wait(lock, dropped);
    } else if (!r->cv.wait_until(lock, deadline, dropped)) {
      break;  // c10d's wait below says it timed out, unless the work completed meanwhile
    }
  }
  if (timeout == ::kNoTimeout) return c10d::Work::wait(timeout);
  // c10d's wait reads 0 ms as no timeout at all: past the deadline, it is given 1 ms (review: a
  // timed wait blocked until the operation finished).
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  return c10d::Work::wait(std::max(std::chrono::milliseconds(1), left));
}

c10::intrusive_ptr<c10::ivalue::Future> Work::getFuture() {
  if (issued_ != nullptr) {
    uint64_t unset = UINT64_MAX;
    issued_before_future_.compare_exchange_strong(unset, issued_->load());
  }
  return future_;
}

int Work::sourceRank() const {
  int r = source_rank_.load();
  TORCH_CHECK(r >= 0, "sourceRank() is only defined for a completed receive");
  return r;
}

bool Work::isCompleted() { return completed(); }

bool Work::completed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_;
}

bool Work::isSuccess() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ && !exception_;
}

GroupWork::GroupWork(int rank, size_t parts)
    : Work(rank, c10d::OpType::COALESCED, "torchpar:coalesced", {}), pending_(parts + 1) {}

c10::intrusive_ptr<GroupWork> GroupWork::create(int rank, const std::vector<c10::intrusive_ptr<Work>>& parts) {
  auto group = c10::make_intrusive<GroupWork>(rank, parts.size());
  for (auto& part : parts) {
    if (part->waits_counted_in()) group->count_waits_in(part->waits_counted_in());  // point-to-point parts
    // Collective parts (a coalesced all-gather, _coalescing_manager): the group's future is the
    // one a user attaches callbacks to, so it counts the group's issued collectives (review).
    if (part->issued_ != nullptr) group->issued_ = part->issued_;
    group->releases_.push_back(part->releases_.front());
    group->parts_.push_back(part);
    // The callback holds the group alive until the last part is done.
    part->getFuture()->addCallback([group](c10::ivalue::Future& f) {
      group->part_done(f.hasError() ? f.exception_ptr() : nullptr);
    });
  }
  group->part_done(nullptr);  // the +1: no completion before every callback is attached
  return group;
}

void GroupWork::part_done(std::exception_ptr error) {
  if (error) {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (!first_error_) first_error_ = error;
  }
  if (pending_.fetch_sub(1) == 1) complete(first_error_);
}

}  // namespace torchpar
