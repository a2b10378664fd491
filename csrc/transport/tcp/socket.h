// The few socket operations the TCP transport needs, each failing with a torchpar::Error
// that names the address and the system's reason.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "transport/request.h"

namespace torchpar::tcp {

// Closes the descriptor when it goes out of scope.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd();
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

// IPv4 addresses of this host's interfaces, loopback excluded; only those of `ifname` if
// it is not empty (an error if it has none).
std::vector<std::string> local_addresses(const std::string& ifname);

// A listening socket on a port the kernel picks: on IPv4 `address`, or on every interface
// if it is empty.
Fd listen_on(const std::string& address, int backlog, uint16_t* port);

// One attempt to connect to `address`:`port`, given up at `deadline`. On failure returns
// no descriptor and sets *error (an errno value; ETIMEDOUT at the deadline).
Fd connect_to(const std::string& address, uint16_t port, Clock::time_point deadline, int* error);

// Whether accept() failing with `err` leaves the listener usable: a connection that died in
// the queue, a network error the kernel passes on (accept(2), "Error handling"), or running
// short of descriptors or memory for a moment. A listener answering strangers must not end
// set-up over any of these.
bool accept_error_passes(int err);

// Accepts one connection, waiting until `deadline`.
Fd accept_until(int listener, Clock::time_point deadline);

// Blocking transfers of exactly `n` bytes, bounded by `deadline`.
void send_all(int fd, const void* data, size_t n, Clock::time_point deadline);
void recv_all(int fd, void* data, size_t n, Clock::time_point deadline);

// Switches a connected socket to what the transport wants: non-blocking, no Nagle delay,
// keep-alive probes (a peer host that vanishes is noticed without a reply ever coming).
void tune_connected(int fd);

}  // namespace torchpar::tcp
