#include "transport/p2p_engine.h"

#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "common/env.h"
#include "common/error.h"
#include "transport/shm/flag.h"

namespace torchpar {
namespace {

constexpr auto kCheckPeriod = std::chrono::milliseconds(50);
constexpr auto kIdleSleep = std::chrono::milliseconds(50);
// What an early message costs beyond its payload (its record in `unexpected_`), counted
// against the cap too: otherwise a peer could queue zero-byte messages without limit.
constexpr size_t kEarlyRecordBytes = 64;

size_t held_bytes(size_t payload) { return payload + kEarlyRecordBytes; }

// The progress thread runs for microseconds at a time, but messages wait for it. Beside ranks
// that compute while their transfers progress (a pipeline stage posts its send and computes
// on, issue 18), a woken thread waits until the computing one has had its slice (EEVDF's
// run-to-parity: 0.75 ms x (1 + log2 cores)) unless its own slice is shorter: since Linux
// 6.12 a SCHED_OTHER thread may ask for one (sched_attr.sched_runtime), and a shorter slice
// preempts on wake-up. TORCHPAR_PROGRESS_SLICE_US asks for it (100 is the kernel's least); the
// default, 0, keeps the kernel's slice: alternated on a quiet machine the 0.1 ms slice showed no
// gain on the pipeline bench (docs/pipeline.md). Older kernels refuse or ignore it.
void ask_for_a_short_slice(int64_t slice_us) {
#if defined(__linux__) && defined(SYS_sched_getattr) && defined(SYS_sched_setattr)
  if (slice_us <= 0) return;
  struct {  // the kernel's struct sched_attr, first version (glibc < 2.41 has no declaration)
    uint32_t size;
    uint32_t policy;
    uint64_t flags;
    int32_t nice;
    uint32_t priority;
    uint64_t runtime, deadline, period;
  } attr{};
  if (::syscall(SYS_sched_getattr, 0, &attr, sizeof(attr), 0) != 0) return;
  if (attr.policy != SCHED_OTHER && attr.policy != SCHED_BATCH) return;  // a user's choice stays
  attr.size = sizeof(attr);
  attr.flags = 0;
  attr.runtime = static_cast<uint64_t>(slice_us) * 1000;  // nanoseconds; policy and nice unchanged
  (void)::syscall(SYS_sched_setattr, 0, &attr, 0);
#endif
}

bool matches(const Request& r, int source, uint64_t tag) {
  return (r.peer == -1 || r.peer == source) && r.tag == tag;
}

std::string describe(const Request& r) {
  std::string who = r.peer < 0 ? std::string("any rank") : "rank " + std::to_string(r.peer);
  return std::string(r.kind == Request::Kind::kSend ? "send to " : "recv from ") + who +
         " (tag " + std::to_string(static_cast<int64_t>(r.tag & 0xffffffffu)) + ", " +
         std::to_string(r.bytes) + " bytes)";
}

// Writes the rest of a message, its header then `req`'s bytes, into the pipe to `peer` as far
// as the pipe takes it. `sent` counts what is written of header and payload together; whoever
// writes the front request (the progress thread, or isend's caller) resumes from it. Returns
// the bytes written by this call.
size_t write_message(Link& link, int peer, const char* header, size_t header_bytes, const Request& req,
                     size_t& sent) {
  const size_t before = sent;
  while (sent < header_bytes + req.bytes) {
    size_t n;
    if (sent < header_bytes) {
      n = link.write_some(peer, header + sent, header_bytes - sent);
    } else {
      size_t off = sent - header_bytes;
      n = link.write_some(peer, static_cast<const char*>(req.data) + off, req.bytes - off);
    }
    if (n == 0) break;  // the pipe is full
    sent += n;
  }
  return sent - before;
}
}  // namespace

P2PEngine::P2PEngine(int rank, int size, Link& link, std::chrono::microseconds spin,
                     std::chrono::microseconds yield, size_t unexpected_max_bytes)
    : rank_(rank), size_(size), link_(link), spin_(spin), yield_(yield),
      unexpected_max_(unexpected_max_bytes), fast_send_(env_int("TORCHPAR_P2P_FAST_SEND", 1) != 0),
      out_(size), in_(size), scratch_(1 << 16) {
  const int64_t slice_us = env_int("TORCHPAR_PROGRESS_SLICE_US", 0);  // a bad value raises here
  thread_ = std::thread([this, slice_us] {
    ::pthread_setname_np(::pthread_self(), "torchpar-p2p");  // for top -H, perf sched, gdb
    ask_for_a_short_slice(slice_us);
    run();
  });
}

P2PEngine::~P2PEngine() { stop(); }

void P2PEngine::stop() {
  if (stop_.exchange(true)) return;
  {
    std::lock_guard<std::mutex> lock(mu_);  // a sleeper between its check and its wait sees it
  }
  stopped_.notify_all();
  link_.notify(rank_);
  if (thread_.joinable()) thread_.join();
  auto error = std::make_exception_ptr(Error("[torchpar] the process group was destroyed"));
  fail(error);
  fail_in_flight(error);  // the progress thread is gone: what it owned is ours now
}

std::exception_ptr P2PEngine::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

std::shared_ptr<Request> P2PEngine::isend(int peer, uint64_t tag, const void* data, size_t bytes,
                                          Clock::time_point deadline) {
  TP_CHECK(peer >= 0 && peer < size_ && peer != rank_, "invalid destination rank ", peer,
           " for a group of size ", size_, " (this is rank ", rank_, ")");
  auto req = std::make_shared<Request>(Request::Kind::kSend, peer, tag, const_cast<void*>(data),
                                       bytes, deadline);
  bool from_caller = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_) {
      req->fail(failure_);
      return req;
    }
    Outbox& box = out_[peer];
    // Only a send with nothing before it to this peer may go now: anything queued or being
    // written must reach the pipe first (messages from one rank arrive in the order sent).
    from_caller = fast_send_ && box.queue.empty() && link_.writable_from_any_thread(peer);
    if (from_caller) {
      box.streaming = true;
      box.caller_writing = true;
    }
    box.queue.push_back(req);
  }
  if (from_caller) {
    send_from_caller(peer, req);
  } else {
    link_.notify(rank_);
  }
  return req;
}

// The progress thread wakes only when it gets a core, which the callers' computation holds
// on a busy host: a pipeline stage that posts an activation and computes on would otherwise
// send it a scheduler slice later (docs/pipeline.md). The caller writes while it owns the
// queue's front (caller_writing), so the pipe still has one writer at a time: the progress
// thread, fail() and the deadline check leave that request alone until the caller hands it
// back under mu_.
void P2PEngine::send_from_caller(int peer, const std::shared_ptr<Request>& req) {
  Outbox& box = out_[peer];
  box.header = WireHeader{req->tag, req->bytes};
  box.sent = 0;
  const size_t total = sizeof(WireHeader) + req->bytes;
  std::string broken;
  try {
    // What the pipe does not take now, the progress thread writes (kHandedOver below).
    write_message(link_, peer, reinterpret_cast<const char*>(&box.header), sizeof(WireHeader), *req, box.sent);
    if (box.sent > 0) link_.notify(peer);
  } catch (const std::exception& e) {  // a corrupt ring: as if the progress thread had met it
    broken = detail::message(__FILE__, __LINE__, "rank ", rank_, "'s ", describe(*req), " failed: ",
                             e.what(), " [the group cannot continue]");
  } catch (...) {  // whatever it was, caller_writing must be cleared below, or the peer's sends stall
    broken = detail::message(__FILE__, __LINE__, "rank ", rank_, "'s ", describe(*req),
                             " failed with an unknown error [the group cannot continue]");
  }
  // fail() leaves a request being written to its writer; a group failed now has failure_ set
  // before this lock is taken, so this caller fails its own request below.
  if (!broken.empty()) fail_group(broken);
  enum { kDone, kFailed, kHandedOver } outcome;
  std::exception_ptr failed;
  bool queued_behind = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    box.caller_writing = false;
    if (box.sent == total) {
      outcome = kDone;
    } else if (failure_) {
      // The progress thread may be gone (stop()) or have failed its requests already: the
      // rest of this message will never be written, so it fails here.
      outcome = kFailed;
      failed = failure_;
    } else {
      outcome = kHandedOver;  // box.sent and box.header tell the progress thread where it is
    }
    if (outcome != kHandedOver) {
      box.queue.pop_front();
      box.streaming = false;
      box.sent = 0;
      // A send queued behind this one while it was ours found the front busy; the progress
      // thread, woken for it, may have gone back to sleep when pump_out saw caller_writing.
      queued_behind = !box.queue.empty();
    }
  }
  if (outcome == kDone) {
    req->complete(peer);
  } else if (outcome == kFailed) {
    req->fail(failed);
  }
  // Handed over: the peer may have drained the pipe while the front was ours.
  if (outcome == kHandedOver || queued_behind) link_.notify(rank_);
}

std::shared_ptr<Request> P2PEngine::irecv(int peer, uint64_t tag, void* data, size_t bytes,
                                          Clock::time_point deadline) {
  TP_CHECK(peer == -1 || (peer >= 0 && peer < size_ && peer != rank_), "invalid source rank ",
           peer, " for a group of size ", size_, " (this is rank ", rank_, ")");
  auto req = std::make_shared<Request>(Request::Kind::kRecv, peer, tag, data, bytes, deadline);
  std::shared_ptr<Unexpected> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_) {
      req->fail(failure_);
      return req;
    }
    bool matched = false;
    for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
      auto& u = *it;
      if (u->claimed || !matches(*req, u->source, u->tag)) continue;
      matched = true;
      if (u->complete) {
        done = u;
        unexpected_.erase(it);  // `u` refers into the list: use `done` from here on
        unexpected_bytes_ -= std::min(unexpected_bytes_, held_bytes(done->data.size()));
      } else {
        u->claimed = req;  // still streaming in; delivered when its last byte arrives
      }
      break;
    }
    if (!matched) posted_.push_back(req);
  }
  if (done) deliver(req, done->source, done->data.data(), done->data.size(), done->tag);
  return req;
}

bool P2PEngine::cancel(const std::shared_ptr<Request>& recv) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find(posted_.begin(), posted_.end(), recv);
    if (it == posted_.end()) return false;
    posted_.erase(it);
  }
  recv->fail(std::make_exception_ptr(Error("[torchpar] " + describe(*recv) + " was cancelled")));
  return true;
}

void P2PEngine::deliver(const std::shared_ptr<Request>& recv, int source, const char* data,
                        size_t bytes, uint64_t tag) {
  if (bytes != recv->bytes) {
    recv->fail(std::make_exception_ptr(UsageError(detail::message(
        __FILE__, __LINE__, describe(*recv), ": rank ", source, " sent a message of ", bytes,
        " bytes with that tag; sizes must match"))));
    return;
  }
  if (bytes) std::memcpy(recv->data, data, bytes);
  recv->complete(source);
}

void P2PEngine::fail(std::exception_ptr error) {
  std::vector<std::shared_ptr<Request>> victims;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_) failure_ = error;
    // A send already streaming belongs to the progress thread (it fails it when it sees
    // failure_); every request not yet started is failed here.
    for (auto& box : out_) {
      auto first = box.queue.begin();
      if (first != box.queue.end() && box.streaming) ++first;
      victims.insert(victims.end(), first, box.queue.end());
      box.queue.erase(first, box.queue.end());
    }
    victims.insert(victims.end(), posted_.begin(), posted_.end());
    posted_.clear();
    for (auto& u : unexpected_) {
      if (u->claimed) victims.push_back(std::move(u->claimed));  // detached: never written to
    }
    unexpected_.clear();
    unexpected_bytes_ = 0;
  }
  // Receives already streaming in belong to the progress thread, which fails them itself.
  link_.notify(rank_);
  for (auto& r : victims) r->fail(error);
}

// Progress thread (or stop(), once it has joined): fails what only it may touch.
void P2PEngine::fail_in_flight(std::exception_ptr error) {
  std::vector<std::shared_ptr<Request>> victims;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& box : out_) {
      auto first = box.queue.begin();
      if (box.caller_writing) ++first;  // its caller completes or fails it (send_from_caller)
      victims.insert(victims.end(), first, box.queue.end());
      box.queue.erase(first, box.queue.end());
      if (box.caller_writing) continue;
      box.streaming = false;
      box.sent = 0;
    }
  }
  for (auto& in : in_) {
    if (in.recv) victims.push_back(in.recv);
    if (in.unexpected && in.unexpected->claimed) victims.push_back(in.unexpected->claimed);
    in = Inbox{};  // the pipes may hold partial messages now: never read them again
  }
  for (auto& r : victims) r->fail(error);
}

void P2PEngine::fail_group(const std::string& why) {
  try {
    fail(std::make_exception_ptr(Error(why)));
    link_.abort(why);
  } catch (...) {  // out of memory, or the store gone: telling the peers is best effort
  }
}

void P2PEngine::run() {
  mark_progress_thread();
  auto idle_since = Clock::now();
  auto last_check = Clock::now();
  while (!stop_.load(std::memory_order_acquire)) {
    // Nothing may leave this thread: an escaping exception would std::terminate the process.
    try {
      step(idle_since, last_check);
    } catch (const std::exception& e) {
      fail_group(detail::message(__FILE__, __LINE__, "rank ", rank_,
                                 "'s point-to-point progress thread failed: ", e.what(),
                                 " [the group cannot continue]"));
    } catch (...) {
      fail_group(detail::message(__FILE__, __LINE__, "rank ", rank_,
                                 "'s point-to-point progress thread failed with an unknown exception"));
    }
  }
}

void P2PEngine::step(Clock::time_point& idle_since, Clock::time_point& last_check) {
  uint32_t seen = link_.activity();
  bool progressed = false;
  if (auto failed = failure()) {
    fail_in_flight(failed);
    // Nothing moves on a failed group (the pipes may hold partial messages, never read
    // again, and a socket with unread bytes would wake every poll): sleep until stop().
    std::unique_lock<std::mutex> lock(mu_);
    stopped_.wait_for(lock, kIdleSleep, [&] { return stop_.load(std::memory_order_acquire); });
    return;
  }
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    progressed |= pump_out(peer);
    progressed |= pump_in(peer);
  }
  auto now = Clock::now();
  if (now - last_check >= kCheckPeriod) {
    last_check = now;
    check_deadlines_and_peers();
  }
  if (progressed) {
    idle_since = now;
    return;
  }
  const bool waited_on = waiters_->load(std::memory_order_relaxed) > 0;
  if (waited_on && now - idle_since < spin_) {
    shm::cpu_relax();
    return;
  }
  if (waited_on && now - idle_since < spin_ + yield_) {
    sched_yield();
    return;
  }
  link_.sleep_until_activity(seen, std::chrono::duration_cast<std::chrono::microseconds>(kIdleSleep));
}

bool P2PEngine::pump_out(int peer) {
  Outbox& box = out_[peer];
  bool progressed = false;
  while (true) {
    std::shared_ptr<Request> req;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (box.queue.empty() || box.caller_writing) break;
      req = box.queue.front();
      box.streaming = true;  // from here the front request belongs to this thread
    }
    if (box.sent == 0) box.header = WireHeader{req->tag, req->bytes};
    const size_t total = sizeof(WireHeader) + req->bytes;
    if (write_message(link_, peer, reinterpret_cast<const char*>(&box.header), sizeof(WireHeader), *req,
                      box.sent) > 0) {
      progressed = true;
    }
    if (progressed) link_.notify(peer);
    if (box.sent < total) break;  // the pipe is full; the peer will notify us as it drains
    {
      std::lock_guard<std::mutex> lock(mu_);
      box.sent = 0;
      box.streaming = false;
      box.queue.pop_front();
    }
    req->complete(peer);
  }
  return progressed;
}

bool P2PEngine::pump_in(int peer) {
  Inbox& in = in_[peer];
  bool progressed = false;
  while (true) {
    if (!in.in_payload) {
      size_t n = link_.read_some(peer, reinterpret_cast<char*>(&in.header) + in.header_got,
                                 sizeof(WireHeader) - in.header_got);
      if (n == 0) break;
      progressed = true;
      in.header_got += n;
      if (in.header_got < sizeof(WireHeader)) continue;
      on_header(peer, in);
      continue;
    }
    size_t want = in.header.bytes - in.got;
    size_t n;
    if (in.target != nullptr) {
      n = link_.read_some(peer, in.target + in.got, want);
    } else {
      n = link_.read_some(peer, scratch_.data(), std::min(want, scratch_.size()));
    }
    if (want > 0 && n == 0) break;
    progressed = progressed || n > 0;
    in.got += n;
    if (in.got == in.header.bytes) on_payload_done(peer, in);
  }
  if (progressed) link_.notify(peer);
  return progressed;
}

// A header's length is a peer's claim, never trusted to size memory. Early arrivals are
// bounded in all by TORCHPAR_UNEXPECTED_MAX_BYTES, and going past it fails the group rather
// than pushing back: back-pressure would stall this peer's pipe on a message nobody has asked
// for yet, so every message queued behind it (other tags, collectives' traffic) would wait
// too and a program that posts its receives late would hang until the timeout instead of
// hearing why. Failing names the peer and the sizes, and the limit can be raised.
void P2PEngine::on_header(int peer, Inbox& in) {
  in.in_payload = true;
  in.got = 0;
  in.target = nullptr;
  const uint64_t bytes = in.header.bytes;
  const int64_t tag = static_cast<int64_t>(in.header.tag & 0xffffffffu);
  std::shared_ptr<Request> recv;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = posted_.begin(); it != posted_.end(); ++it) {
      if (matches(**it, peer, in.header.tag)) {
        recv = *it;
        posted_.erase(it);
        break;
      }
    }
    if (!recv) {
      const size_t room = unexpected_max_ - std::min(unexpected_bytes_, unexpected_max_);
      TP_CHECK(bytes <= unexpected_max_ && held_bytes(bytes) <= room, "rank ", peer, " sent a message of ", bytes,
               " bytes (tag ", tag, ") before rank ", rank_,
               " posted a receive for it, with ", unexpected_bytes_,
               " bytes of such early messages held already; holding it would exceed TORCHPAR_UNEXPECTED_MAX_BYTES=",
               unexpected_max_, " (post the receive sooner, or raise the limit)");
      auto u = std::make_shared<Unexpected>();
      u->source = peer;
      u->tag = in.header.tag;
      u->data.resize(bytes);
      unexpected_bytes_ += held_bytes(bytes);
      unexpected_.push_back(u);
      in.unexpected = u;
      in.target = u->data.data();
    }
  }
  if (recv) {
    if (recv->bytes == bytes) {
      in.recv = recv;
      in.target = static_cast<char*>(recv->data);
    } else {
      // A size mismatch fails this receive only, and the payload is read and dropped so the
      // pipe stays in step; but a length no message could have (more than the early-arrival
      // limit, e.g. 2^64-1) means the stream itself is corrupt.
      // The receive fails first: once off posted_, nothing else would ever complete it.
      deliver(recv, peer, nullptr, bytes, in.header.tag);
      TP_CHECK(bytes <= unexpected_max_, "rank ", peer, " sent a message of ", bytes, " bytes (tag ", tag,
               ") to a receive of ", recv->bytes,
               " bytes, more than TORCHPAR_UNEXPECTED_MAX_BYTES=", unexpected_max_,
               " to read and drop; the stream from it cannot be trusted");
    }
  }
  if (bytes == 0) on_payload_done(peer, in);
}

void P2PEngine::on_payload_done(int peer, Inbox& in) {
  if (in.recv) {
    in.recv->complete(peer);
  } else if (in.unexpected) {
    std::shared_ptr<Request> claimed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      in.unexpected->complete = true;
      claimed = in.unexpected->claimed;
      if (claimed) {
        unexpected_.remove(in.unexpected);
        unexpected_bytes_ -= std::min(unexpected_bytes_, held_bytes(in.unexpected->data.size()));
      }
    }
    if (claimed) {
      deliver(claimed, peer, in.unexpected->data.data(), in.unexpected->data.size(),
              in.unexpected->tag);
    }
  }
  in = Inbox{};
}

void P2PEngine::check_deadlines_and_peers() {
  auto now = Clock::now();
  std::vector<std::shared_ptr<Request>> expired;
  std::vector<bool> watch(size_, false);
  bool stream_broken = false;
  std::string broken_what;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_) return;
    for (int peer = 0; peer < size_; ++peer) {
      auto& q = out_[peer].queue;
      for (auto it = q.begin(); it != q.end();) {
        bool front = it == q.begin();
        if (front && out_[peer].caller_writing) {
          // Its caller's, which never blocks: what it cannot write goes back to this thread
          // (then watched). Watching the peer now would fail a send whose bytes are all out
          // when that peer, done with them, closes its end before the caller marks the send
          // complete: the failure then took every other pending request with it.
          ++it;
          continue;
        }
        bool started = front && out_[peer].sent > 0;
        if ((*it)->deadline <= now && !started) {
          expired.push_back(*it);
          it = q.erase(it);
          if (front) out_[peer].streaming = false;
          continue;
        }
        if ((*it)->deadline <= now) {
          stream_broken = true;
          broken_what = describe(**it);
        }
        watch[peer] = true;
        ++it;
      }
    }
    for (auto it = posted_.begin(); it != posted_.end();) {
      if ((*it)->deadline <= now) {
        expired.push_back(*it);
        it = posted_.erase(it);
        continue;
      }
      if ((*it)->peer >= 0) {
        watch[(*it)->peer] = true;
      } else {
        std::fill(watch.begin(), watch.end(), true);
      }
      ++it;
    }
    for (auto& u : unexpected_) {
      if (u->claimed && !u->complete) {
        watch[u->source] = true;
        if (u->claimed->deadline <= now) {
          stream_broken = true;
          broken_what = describe(*u->claimed);
        }
      }
    }
  }
  for (int peer = 0; peer < size_; ++peer) {
    if (in_[peer].recv) {
      watch[peer] = true;
      if (in_[peer].recv->deadline <= now) {
        stream_broken = true;
        broken_what = describe(*in_[peer].recv);
      }
    }
  }
  for (auto& r : expired) {
    r->fail(std::make_exception_ptr(TimeoutError(detail::message(
        __FILE__, __LINE__, describe(*r), " timed out: rank ",
        r->peer < 0 ? std::string("(any)") : std::to_string(r->peer),
        " did not ", r->kind == Request::Kind::kSend ? "receive" : "send", " it in time"))));
  }
  if (stream_broken) {
    fail(std::make_exception_ptr(TimeoutError(detail::message(
        __FILE__, __LINE__, broken_what, " timed out part-way through the message"))));
    return;
  }
  for (int peer = 0; peer < size_; ++peer) {
    if (!watch[peer] || peer == rank_) continue;
    try {
      link_.check_peer(peer);
    } catch (const Error&) {
      // Shared memory outlives its writer: a peer that wrote what this rank waits for and then
      // exited (its last message, at the end of a job) has not failed it. Read what it left;
      // if that was anything, the next check decides on what is then still pending (a TCP
      // peer is lost only once its bytes are read: EOF comes after them).
      if (pump_in(peer)) continue;
      fail(std::current_exception());
      return;
    } catch (const std::exception& e) {  // a transport's own failure must not end the thread
      fail(std::make_exception_ptr(Error(detail::message(__FILE__, __LINE__, "checking on rank ", peer,
                                                         " failed: ", e.what()))));
      return;
    }
  }
}

}  // namespace torchpar
