// Tag-matched asynchronous send and receive between the ranks of a group.
//
// Matching follows MPI: a message from `src` with `tag` goes to the first posted receive
// (in posting order) that names that source (or any source) and tag; messages from one
// source are matched in the order they were sent. A message that arrives before its
// receive is posted is buffered, so a pipe never stalls on it: any pattern in which every
// rank posts all its sends and receives before waiting completes. A send completes once
// its bytes are in the pipe; a message may be far larger than the pipe.
//
// One progress thread drives all pipes; callers post and wait. A send that finds nothing
// before it to its peer is written by its caller, as far as the pipe has room, when the
// pipe allows that (Link::writable_from_any_thread: a ring, a socket): it then leaves at once,
// not when the progress thread next gets a core (issue 18). TORCHPAR_P2P_FAST_SEND=0 queues
// every send for the progress thread instead.
//
// What comes out of a pipe is untrusted: a header's length never sizes an allocation beyond
// `unexpected_max_bytes` of early arrivals in all, and anything the progress thread throws
// fails the group (Link::abort) instead of ending the process.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/link.h"
#include "transport/request.h"

namespace torchpar {

class P2PEngine {
 public:
  // After its last progress the thread spins for `spin`, then yields the CPU between looks
  // until `spin + yield`, then sleeps until a peer notifies it; it spins and yields only while
  // a caller is blocked on one of its requests (see waiters()).
  P2PEngine(int rank, int size, Link& link, std::chrono::microseconds spin,
            std::chrono::microseconds yield, size_t unexpected_max_bytes);
  ~P2PEngine();
  P2PEngine(const P2PEngine&) = delete;
  P2PEngine& operator=(const P2PEngine&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }

  std::shared_ptr<Request> isend(int peer, uint64_t tag, const void* data, size_t bytes,
                                 Clock::time_point deadline);
  // `peer` = -1 receives from any source; Request::source() then tells which.
  std::shared_ptr<Request> irecv(int peer, uint64_t tag, void* data, size_t bytes,
                                 Clock::time_point deadline);

  // Withdraws a receive that no message has matched yet: it fails with "cancelled" and its
  // buffer is never written. Returns false (and changes nothing) once a message matched it.
  bool cancel(const std::shared_ptr<Request>& recv);

  // Fails every pending request, and every later one, with `error`.
  void fail(std::exception_ptr error);
  // Stops the progress thread; pending requests fail.
  void stop();

  // How many callers are blocked waiting on a request of this engine; the backend's Work
  // counts them. Polling for a message (spin, then yield) pays only while a caller waits:
  // beside a caller that computes while its transfers progress (a pipeline schedule posts
  // receives early), a polling thread takes the core the computation needs (issue 18). A
  // sleeping thread misses nothing: a peer's write rings the doorbell, and step() reads the
  // doorbell before it looks at the pipes.
  const std::shared_ptr<std::atomic<int>>& waiters() const { return waiters_; }

 private:
  struct WireHeader {
    uint64_t tag;
    uint64_t bytes;
  };
  // A message that arrived before a receive matched it.
  struct Unexpected {
    int source;
    uint64_t tag;
    std::vector<char> data;
    bool complete = false;
    std::shared_ptr<Request> claimed;  // a receive waiting for the rest of it
  };
  struct Outbox {
    std::deque<std::shared_ptr<Request>> queue;  // guarded by mu_
    bool streaming = false;  // guarded by mu_: queue.front() is being written, by its writer
    // Guarded by mu_: the front's writer is the caller of isend (send_from_caller), not the
    // progress thread; implies `streaming`. Nothing else touches that request, `header` or
    // `sent` until the caller clears it.
    bool caller_writing = false;
    // The front's writer only (the progress thread, or the caller while caller_writing; the
    // one hands over to the other under mu_):
    WireHeader header{};
    size_t sent = 0;  // bytes of queue.front() written so far
  };
  struct Inbox {
    WireHeader header{};
    size_t header_got = 0;
    bool in_payload = false;
    size_t got = 0;
    char* target = nullptr;  // where the payload goes; null: discard
    std::shared_ptr<Request> recv;
    std::shared_ptr<Unexpected> unexpected;
  };

  // isend's fast path: writes `req`, which isend made the front of `peer`'s queue with
  // caller_writing set, as far as the pipe takes it, then completes it or hands the rest to
  // the progress thread.
  void send_from_caller(int peer, const std::shared_ptr<Request>& req);
  void run();
  // One pass of the progress loop (run() catches what it throws).
  void step(Clock::time_point& idle_since, Clock::time_point& last_check);
  bool pump_out(int peer);
  bool pump_in(int peer);
  void on_header(int peer, Inbox& in);
  void on_payload_done(int peer, Inbox& in);
  void check_deadlines_and_peers();
  // The progress thread cannot go on (a bad frame, an exception): fail every request here
  // and the group everywhere, with `why`.
  void fail_group(const std::string& why);
  void fail_in_flight(std::exception_ptr error);
  static void deliver(const std::shared_ptr<Request>& recv, int source, const char* data,
                      size_t bytes, uint64_t tag);
  std::exception_ptr failure() const;

  const int rank_;
  const int size_;
  Link& link_;
  const std::chrono::microseconds spin_;
  const std::chrono::microseconds yield_;
  const size_t unexpected_max_;
  const bool fast_send_;  // TORCHPAR_P2P_FAST_SEND

  mutable std::mutex mu_;
  std::vector<Outbox> out_;
  std::vector<Inbox> in_;  // progress thread only
  std::list<std::shared_ptr<Request>> posted_;       // receives not yet matched
  std::list<std::shared_ptr<Unexpected>> unexpected_;  // in arrival order
  size_t unexpected_bytes_ = 0;  // held by unexpected_ and by early arrivals being delivered
  std::exception_ptr failure_;
  std::vector<char> scratch_;  // progress thread only

  std::shared_ptr<std::atomic<int>> waiters_ = std::make_shared<std::atomic<int>>(0);
  std::atomic<bool> stop_{false};
  std::condition_variable stopped_;  // with mu_: where the thread waits once the group failed
  std::thread thread_;
};

}  // namespace torchpar
