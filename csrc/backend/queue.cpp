#include "backend/queue.h"

#include <c10/util/Exception.h>
#include <pthread.h>

#include <map>
#include <regex>
#include <set>
#include <utility>

#include "backend/errors.h"
#include "transport/hosts.h"

namespace torchpar {
namespace {
// The queue whose operation this thread is running now (its worker, or a caller running one
// inline), if any: a future callback that issues an operation re-enters submit() here.
thread_local const CollectiveQueue* running_here = nullptr;

// A failure of a group spanning hosts names ranks ("rank 3 (pid 860) has exited", relayed
// from the rank that saw it; "recv from rank 2 ... timed out"), and a rank number alone does
// not say which machine to look at. For each rank of another host that `message` names, this
// says which host (the hierarchy's host map: "host 1 (ranks 2, 3)"), once per host (issue 21).
// The message is scanned rather than each place that names a peer being taught the map,
// because the names also arrive as text: the abort reason another rank published.
std::string hosts_named(const std::string& message, const HostMap& map, int rank) {
  static const std::regex kRank(R"(\brank (\d{1,9})\b)");
  std::map<int, std::set<int>> named;  // host -> its ranks the message names
  for (std::sregex_iterator it(message.begin(), message.end(), kRank), end; it != end; ++it) {
    const int r = std::stoi((*it)[1].str());
    if (r < static_cast<int>(map.host_of.size()) && !map.same_host(r, rank)) named[map.host_of[r]].insert(r);
  }
  std::string note;
  for (const auto& [host, ranks] : named) {
    std::string who;
    for (int r : ranks) who += (who.empty() ? "" : ", ") + std::to_string(r);
    note += std::string(note.empty() ? "" : "; ") + (ranks.size() > 1 ? "ranks " : "rank ") + who + " on " +
            map.describe(host);
  }
  return note.empty() ? "" : " [" + note + "]";
}
}  // namespace

CollectiveQueue::CollectiveQueue(Transport& transport, const Config& config, int rank, int size,
                                 std::string group_name)
    : transport_(transport), config_(config), rank_(rank), size_(size), group_name_(std::move(group_name)) {
  worker_ = std::thread([this] {
    ::pthread_setname_np(::pthread_self(), "torchpar-coll");  // for top -H, perf sched, gdb
    run_worker();
  });
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
  work->released_by_completer();  // finish() completes it
  Queued item{std::move(work), name, std::move(task), timeout};
  if (running_here == this) {
    // A callback on the future of an operation this thread just finished issues another.
    // Nobody else runs the queue until the callback returns, so an operation queued now and
    // waited on by the callback would never start (issue 21): it runs here. Where in the
    // order: where NCCL's futures, complete at issue, put it, the same on every rank however
    // far each rank's main thread has got. A callback attached to such a future runs when it
    // is attached, after what was issued before that. So the collectives issued before the
    // finished operation's future was taken run first (a callback cannot be attached before),
    // then this one, ahead of what was issued later. A DDP comm hook takes the future as it
    // issues the bucket's all-reduce: PowerSGD's further all-reduces (Vogels et al. 2019) run
    // right after it, before the next bucket's; running the whole queue first put the next
    // bucket's before them on a rank whose main thread was ahead, and not on another (a
    // mismatch). A future taken after later collectives were issued keeps those first (review:
    // running none first swapped two same-sized all-reduces between ranks, silently).
    {
      std::lock_guard<std::mutex> lock(mu_);
      TORCH_CHECK(!stopping_, "torchpar ", name, ": group '", group_name_, "' has been shut down");
      item.issue = issued_->fetch_add(1);
    }
    const Work* finished = Work::completing_here();
    const uint64_t before = finished != nullptr ? finished->issued_before_future() : 0;
    while (run_front_issued_before(before)) {
    }
    execute(item, /*caller_blocks=*/!async_op);
    return;
  }
  // Queued: a callback of an earlier operation may wait() on it (Work::wait, run_queued_here).
  item.work->set_queue(this, issued_);
  // On the point-to-point progress thread (a callback on a send's or recv's future), a
  // blocking collective would wait for that very thread; an async one is left to the worker.
  if (!async_op) check_not_on_progress_thread("a blocking collective");
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(!stopping_, "torchpar ", name, ": group '", group_name_, "' has been shut down");
    item.issue = issued_->fetch_add(1);  // under the lock: the queue stays in the order of issue
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

bool CollectiveQueue::running_on_this_thread() const { return running_here == this; }

void CollectiveQueue::run_queued_here(const Work* until) {
  TORCH_INTERNAL_ASSERT(running_here == this, "run_queued_here off the thread running the queue");
  // What is queued now, taken one at a time from the queue itself: a callback of one of them
  // that waits on a later one finds it there (review: with the queue moved aside first, a
  // chain of two such callbacks waited on itself).
  size_t left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    left = queue_.size();
  }
  for (; left > 0 && !until->completed(); --left) {
    if (!run_front_issued_before(UINT64_MAX)) return;  // a nested wait ran the rest
  }
}

bool CollectiveQueue::run_front_issued_before(uint64_t issue) {
  Queued q;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (queue_.empty() || queue_.front().issue >= issue) return false;
    q = std::move(queue_.front());
    queue_.pop_front();
  }
  execute(q, /*caller_blocks=*/false);
  return true;
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
  const CollectiveQueue* outer = std::exchange(running_here, this);
  struct Restore {
    const CollectiveQueue* outer;
    ~Restore() { running_here = outer; }
  } restore{outer};
  uint64_t seq = next_seq_++;
  recent_[seq % recent_.size()] = item.name;
  std::exception_ptr failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    failed = group_error_;
  }
  if (failed) {
    finish(item, failed);
    return;
  }
  std::exception_ptr error;
  try {
    collectives::Comm comm{transport_.arena(), transport_.p2p(), config_, Clock::now() + item.timeout, seq,
                           caller_blocks, &scratch_};
    comm.hierarchy = transport_.hierarchy();
    item.task(comm);
  } catch (...) {
    error = std::current_exception();
    bool fatal = true;
    // Nothing may leave this handler: on the worker thread it would end the process, and the
    // waiter would never be told. If explaining the failure fails (out of memory, say), the
    // failure goes out as it came, and still fails the group.
    try {
      error = describe_failure({item.name, rank_, size_, group_name_, seq, item.timeout}, error, &fatal,
                               [this] { return transport_.abort_reason(); });
      // Only failures: a mismatch (UsageError) must read the same on every rank.
      if (fatal) {
        std::string msg = message_of(error);
        std::string note;
        if (const Hierarchy* h = transport_.hierarchy(); h != nullptr) {
          note = hosts_named(msg, h->map, rank_);
          if (msg.find(note) != std::string::npos) note.clear();
        }
        note += recent_collectives(seq);
        // Before describe_failure's closing " [the group is no longer usable]", beside what it explains.
        const std::string closing = " [the group is no longer usable]";
        const bool closed = msg.size() >= closing.size() && msg.compare(msg.size() - closing.size(), closing.size(), closing) == 0;
        error = dist_backend_error(closed ? msg.insert(msg.size() - closing.size(), note) : msg + note);
      }
    } catch (...) {
    }
    if (fatal) {
      try {
        transport_.abort(message_of(error));
      } catch (...) {
        // The peers learn of it from their own timeouts; this rank's group fails below.
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (!group_error_) group_error_ = error;
    }
  }
  finish(item, error);
}

std::string CollectiveQueue::recent_collectives(uint64_t seq) const {
  // Those before `seq`, which the message names already.
  const uint64_t begin = seq > recent_.size() - 1 ? seq - (recent_.size() - 1) : 0;
  if (begin == seq) return "";
  std::string out = " [rank " + std::to_string(rank_) + "'s collectives before it:";
  for (uint64_t s = begin; s < seq; ++s) {
    out += std::string(s == begin ? " #" : ", #") + std::to_string(s) + " " + recent_[s % recent_.size()];
  }
  return out + "]";
}

void CollectiveQueue::finish(Queued& item, std::exception_ptr error) {
  // Completing runs the future's callbacks; nothing they throw may leave the worker thread
  // (std::terminate), and the operation itself is over either way.
  // The task's closure holds the caller's tensors (the inputs above all): drop them before the
  // waiter wakes, so that the caller's own reference is the last one and the memory is freed on
  // the caller's thread when it lets go, not later on this worker (a buffer freed here stayed
  // allocated past wait() by however long this thread took, e.g. an FSDP reduce-scatter's packed
  // gradients into the optimizer step; issue 19).
  item.task = nullptr;
  try {
    Work::complete_and_release(std::move(item.work), error);
  } catch (const std::exception& e) {
    TORCH_WARN("torchpar ", item.name, ": completing the operation failed: ", e.what());
  } catch (...) {
    TORCH_WARN("torchpar ", item.name, ": completing the operation failed");
  }
}

}  // namespace torchpar
