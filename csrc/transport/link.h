// What the point-to-point engine needs from a transport: an ordered byte pipe to each
// peer, and a way to sleep until any of them changes. Shared memory provides it with
// rings and a futex doorbell; a TCP transport would provide it with sockets and epoll.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace torchpar {

class Link {
 public:
  virtual ~Link() = default;
  // Non-blocking; return how many bytes moved.
  virtual size_t write_some(int peer, const void* data, size_t n) = 0;
  virtual size_t read_some(int peer, void* data, size_t n) = 0;
  // Tells `peer` that its view of our pipes changed (data written, or room freed).
  virtual void notify(int peer) = 0;
  // A counter that moves whenever a peer notifies this rank.
  virtual uint32_t activity() const = 0;
  virtual void sleep_until_activity(uint32_t seen, std::chrono::microseconds max_sleep) = 0;
  // Throws torchpar::Error if the group has failed or `peer` is no longer alive.
  virtual void check_peer(int peer) = 0;
  // Marks the group failed for every rank (first reason wins) and fails pending requests.
  // The engine calls it when a pipe carries something it cannot go on from.
  virtual void abort(const std::string& reason) = 0;
  // Whether write_some(peer, ...) and notify(peer) may run on a thread other than the one
  // that drives the engine, one writer at a time (the engine sees to that): its send fast
  // path writes from the caller of isend. A shared-memory ring keeps all its state in the
  // ring; a socket's writer records, in an atomic, for the progress thread's poll that it
  // wants POLLOUT.
  virtual bool writable_from_any_thread(int peer) const {
    (void)peer;
    return false;
  }
};

}  // namespace torchpar
