// TCP transport for a group whose ranks do not all share a host: one connection per pair
// of ranks, non-blocking, driven by the point-to-point engine; the engine sleeps in poll()
// on every socket plus an eventfd that local posts ring.
//
// Set-up goes through the rendezvous: each rank listens on a kernel-chosen port and
// publishes it with its host identity and IPv4 addresses; the higher rank of each pair
// connects (over loopback when both share a host), and the two prove to each other that
// they know the group's secret (transport/tcp/handshake.h).
#pragma once

#include <poll.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/env.h"
#include "transport/rendezvous.h"
#include "transport/tcp/handshake.h"
#include "transport/tcp/socket.h"
#include "transport/transport.h"

namespace torchpar::tcp {

class TcpTransport final : public Transport {
 public:
  // Collective over the group: returns once this rank is connected to every peer, or to
  // those `remote` marks ([peer] != 0; empty: all). Without `own_engine` it starts no
  // point-to-point engine: a transport spanning hosts (mixed_transport.h) drives these
  // sockets from the engine of the whole group, with shared memory for the other peers.
  TcpTransport(int rank, int size, Rendezvous& rendezvous, const Config& config,
               std::chrono::milliseconds timeout, std::vector<char> remote = {}, bool own_engine = true);
  ~TcpTransport() override;

  const char* name() const override { return "tcp"; }
  P2PEngine& p2p() override;
  // Publishes `reason` in the rendezvous (peers read it when their connection to this rank
  // ends) and shuts every connection down, so peers waiting on this rank fail at once.
  void abort(const std::string& reason) override;
  void leave() override;
  std::string abort_reason() override;

  // Link
  size_t write_some(int peer, const void* data, size_t n) override;
  size_t read_some(int peer, void* data, size_t n) override;
  void notify(int peer) override;
  uint32_t activity() const override { return activity_.load(std::memory_order_acquire); }
  void sleep_until_activity(uint32_t seen, std::chrono::microseconds max_sleep) override;
  void check_peer(int peer) override;
  // send() on a socket may run beside the progress thread's recv() and poll() on it; the
  // engine keeps one writer per peer at a time.
  bool writable_from_any_thread(int) const override { return true; }

 private:
  void connect_all(Rendezvous& rendezvous, const Config& config, std::chrono::milliseconds timeout);
  // Connects to lower rank `peer` at one of `addresses` and introduces this rank.
  void call(int peer, std::vector<std::string> addresses, uint16_t port, const Secret& secret,
            Clock::time_point deadline);
  // Accepts and answers every higher rank on `listener`, many handshakes at once, each with
  // a short deadline; returns once all have connected (or when `stop` is set).
  void answer(int listener, const Secret& secret, Clock::time_point deadline, const std::atomic<bool>& stop);
  struct Pending;
  // Records why the connection to `peer` broke (first reason wins); the engine hears of it
  // through check_peer. `readable`: only writing failed, and what the peer sent before it
  // went is read on until the stream ends (its last messages are still owed to this rank).
  void lost(int peer, const std::string& why, bool readable = false);

  const int rank_;
  const int size_;
  const std::vector<char> remote_;  // [peer]: connected over TCP (every peer, by default)
  Rendezvous& rendezvous_;  // outlives the transport (the backend holds both)
  std::vector<Fd> sockets_;           // [peer]
  // [peer]: the socket was full, so the progress thread's poll waits for room. Set by whoever
  // wrote last (the progress thread, or the caller of an isend: writable_from_any_thread).
  std::vector<std::atomic<bool>> want_write_;
  std::vector<std::atomic<bool>> broken_;  // [peer]: stop polling it
  std::vector<std::atomic<bool>> unwritable_;  // [peer]: a write failed; reading goes on (lost())
  std::vector<pollfd> polled_;        // progress thread only: what sleep_until_activity polls
  std::vector<int> polled_peers_;     // progress thread only: the peer of each socket in polled_
  Fd wakeup_;                          // eventfd: notify(rank_) from posting threads
  std::atomic<uint32_t> activity_{0};

  std::mutex mu_;
  std::vector<std::string> lost_;  // [peer]: why its connection broke, "" while healthy
  std::string aborted_;

  std::unique_ptr<P2PEngine> p2p_;
  // p2p_ once the constructor has stored it. The engine's thread runs from inside its own
  // constructor and may abort() on a bad frame at once; abort() reads this, not p2p_, which
  // the constructing thread may still be writing (the engine fails itself in that case).
  std::atomic<P2PEngine*> engine_{nullptr};
};

}  // namespace torchpar::tcp
