// The handle torch.distributed returns for a torchpar operation.
//
// wait(timeout) blocks until the operation finished and rethrows its error (a
// torch.distributed.DistBackendError naming the operation, group and rank at fault);
// isCompleted/isSuccess/exception never block; getFuture() resolves to the list of output
// tensors; sourceRank() tells where an any-source receive came from.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <cstdint>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace torchpar {

class CollectiveQueue;

class Work : public c10d::Work {
 public:
  Work(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs);

  // Finishes the work (successfully when `error` is null) and resolves the future.
  void complete(std::exception_ptr error = nullptr);
  // For the thread that runs the work (the queue's worker, the point-to-point progress
  // thread), which holds a reference to it: marked before the work is handed to that thread,
  // the work is completed with complete_and_release(), which drops that reference, and wait()
  // returns only after the drop. Were that reference the last one, whatever the work holds (its
  // outputs; the caller's tensors) would otherwise be freed on that thread after wait()
  // returned, whenever it got to it, and not on the caller's thread when the caller lets go
  // (issue 19: an FSDP unit-order all-gather's outputs freed on the worker, seen by
  // tests/test_fsdp.py's allocation count on a loaded machine). A future's wait() does not wait.
  void released_by_completer();
  static void complete_and_release(c10::intrusive_ptr<Work> work, std::exception_ptr error = nullptr);
  void set_source_rank(int rank) { source_rank_.store(rank); }
  // A point-to-point work: wait() counts itself in its engine's `waiters` while it blocks
  // (P2PEngine::waiters says why).
  void count_waits_in(std::shared_ptr<std::atomic<int>> waiters) { waiters_ = std::move(waiters); }
  // A collective waiting in its group's queue. Only compared with the queue this thread is
  // running (alive while it does), never followed otherwise: the work may outlive its group.
  // `issued` counts the group's collectives issued so far (shared: it outlives the group).
  void set_queue(CollectiveQueue* queue, std::shared_ptr<const std::atomic<uint64_t>> issued) {
    queue_ = queue;
    issued_ = std::move(issued);
  }
  // How many of its group's collectives had been issued when the future was first taken (every
  // one issued before a callback could be attached to it); none taken yet: the most there is.
  uint64_t issued_before_future() const { return issued_before_future_.load(); }
  // The work whose completion (so whose future's callbacks) this thread is running, if any.
  static const Work* completing_here();
  const std::shared_ptr<std::atomic<int>>& waits_counted_in() const { return waiters_; }

  // Refuses to block the point-to-point progress thread (see check_not_on_progress_thread).
  bool wait(std::chrono::milliseconds timeout = ::kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override { return outputs_; }
  int sourceRank() const override;
  bool isCompleted() override;
  bool isSuccess() const override;
  bool completed() const;

 private:
  friend class GroupWork;  // takes on its parts' releases

  // One completing thread's reference to a work, owed until that thread drops it.
  struct Release {
    bool owed = false;  // set before the work is shared, read unlocked
    std::mutex mu;
    std::condition_variable cv;
    std::thread::id completer;  // the thread inside complete_and_release, once it is
    bool dropped = false;
  };
  // What wait() waits for before the work's own completion: its own release, and a group's
  // parts' (a group completes inside its last part's completion, before that part is dropped).
  std::vector<std::shared_ptr<Release>> releases_{std::make_shared<Release>()};

  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::atomic<int> source_rank_{-1};
  std::shared_ptr<std::atomic<int>> waiters_;
  CollectiveQueue* queue_ = nullptr;
  std::shared_ptr<const std::atomic<uint64_t>> issued_;
  std::atomic<uint64_t> issued_before_future_{UINT64_MAX};
};

// Completes when every added piece has completed; fails with the first piece's error.
// Used for coalesced point-to-point batches (batch_isend_irecv).
class GroupWork : public Work {
 public:
  static c10::intrusive_ptr<GroupWork> create(int rank, const std::vector<c10::intrusive_ptr<Work>>& parts);
  explicit GroupWork(int rank, size_t parts);

 private:
  void part_done(std::exception_ptr error);

  std::atomic<size_t> pending_;
  // Held so that the parts (their outputs) go when the group does, on the caller's thread: their
  // completing threads have let go of them by the time wait() returns.
  std::vector<c10::intrusive_ptr<Work>> parts_;
  std::mutex error_mu_;
  std::exception_ptr first_error_;
};

}  // namespace torchpar
