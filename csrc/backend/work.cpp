#include "backend/work.h"

#include <ATen/core/jit_type.h>

#include "transport/request.h"

namespace torchpar {

Work::Work(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type, title),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

void Work::complete(std::exception_ptr error) {
  // The future first: whoever wait()s on the work may read the future's value next.
  if (error) {
    future_->setError(error);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
  finish(error);
}

void Work::complete_and_release(c10::intrusive_ptr<Work> work, std::exception_ptr error) {
  std::shared_ptr<Release> release = work->releases_.front();
  release->owed.store(true, std::memory_order_relaxed);  // published by complete()'s lock
  struct Drop {  // also when complete() throws
    c10::intrusive_ptr<Work>& work;
    Release& release;
    ~Drop() {
      work.reset();
      release.dropped.store(true, std::memory_order_release);
      release.dropped.notify_all();
    }
  } drop{work, *release};
  work->complete(error);
}

void Work::await_releases() const {
  for (const auto& r : releases_) {
    if (r->owed.load(std::memory_order_relaxed)) r->dropped.wait(false, std::memory_order_acquire);
  }
}

bool Work::wait(std::chrono::milliseconds timeout) {
  // However wait() leaves once the work has completed (its error rethrown too): see
  // complete_and_release. The completing thread drops its reference right after completing.
  struct AwaitReleases {
    Work& work;
    ~AwaitReleases() {
      if (work.isCompleted()) work.await_releases();
    }
  } await_releases{*this};
  if (isCompleted()) return c10d::Work::wait(timeout);
  check_not_on_progress_thread("wait() on a torchpar work");
  if (!waiters_) return c10d::Work::wait(timeout);
  // A point-to-point work is counted while it blocks: its engine's progress thread polls for
  // transfers only then (P2PEngine::waiters).
  struct Waiting {
    std::atomic<int>& count;
    explicit Waiting(std::atomic<int>& n) : count(n) { count.fetch_add(1, std::memory_order_relaxed); }
    ~Waiting() { count.fetch_sub(1, std::memory_order_relaxed); }
  } waiting(*waiters_);
  return c10d::Work::wait(timeout);
}

int Work::sourceRank() const {
  int r = source_rank_.load();
  TORCH_CHECK(r >= 0, "sourceRank() is only defined for a completed receive");
  return r;
}

bool Work::isCompleted() {
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
    // The group completes inside its last part's completion, before that part's thread lets go of it.
    group->releases_.push_back(part->releases_.front());
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
