// The transport of a group spanning hosts (issue 21): shared-memory rings to the ranks of
// this host, TCP to the others, under one point-to-point engine. The Link routes each peer
// to its pipe, so isend/irecv and the point-to-point collectives run at shared-memory speed
// between ranks of one host. The host's arena serves the hierarchical collectives
// (collectives/hierarchical.h), which reduce inside each host and talk TCP between leaders.
//
// Waiting: the engine sleeps in poll() on the sockets and the TCP side's eventfd; a thread
// sleeps on the shared-memory doorbell (a futex, which poll() cannot watch) and rings that
// eventfd whenever a rank of this host rings the doorbell.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "common/env.h"
#include "transport/hosts.h"
#include "transport/rendezvous.h"
#include "transport/shm/shm_transport.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/transport.h"

namespace torchpar {

class MixedTransport final : public Transport {
 public:
  // Collective over the group. `hosts` says which ranks share a host (connect() derives it
  // from the ranks' HostIdentity; tests make hosts up); it must span at least two hosts.
  // With `hierarchical`, hierarchy() offers the collectives the host map and arena.
  MixedTransport(int rank, int size, Rendezvous& rendezvous, const Config& config,
                 std::chrono::milliseconds timeout, HostMap hosts, bool hierarchical = true);
  ~MixedTransport() override;

  const char* name() const override { return "mixed"; }
  P2PEngine& p2p() override { return *engine_; }
  const Hierarchy* hierarchy() const override { return hierarchical_ ? &hierarchy_ : nullptr; }
  const HostMap& hosts() const { return hierarchy_.map; }
  // Whether `peer` is reached through shared memory (tests, logs).
  bool shares_memory_with(int peer) const { return hosts().same_host(peer, rank_) && shm_ != nullptr; }
  // The host's shared-memory transport, or null when this rank is alone on its host.
  shm::ShmTransport* host_transport() { return shm_.get(); }

  void abort(const std::string& reason) override;
  void leave() override;
  std::string abort_reason() override { return tcp_->abort_reason(); }

  // Link
  size_t write_some(int peer, const void* data, size_t n) override;
  size_t read_some(int peer, void* data, size_t n) override;
  void notify(int peer) override;
  uint32_t activity() const override;
  void sleep_until_activity(uint32_t seen, std::chrono::microseconds max_sleep) override;
  void check_peer(int peer) override;
  bool writable_from_any_thread(int peer) const override {
    return local(peer) ? shm_->writable_from_any_thread(local_index(peer)) : tcp_->writable_from_any_thread(peer);
  }

 private:
  bool local(int peer) const { return shm_ && hosts().same_host(peer, rank_); }
  int local_index(int peer) const { return hosts().local_rank[peer]; }
  // Rings the TCP side's eventfd whenever this host's doorbell moves (see above).
  void watch_doorbell();

  const int rank_;
  const int size_;
  const bool hierarchical_;
  Hierarchy hierarchy_;
  std::unique_ptr<shm::ShmTransport> shm_;  // this host's ranks (null: alone on its host)
  std::unique_ptr<tcp::TcpTransport> tcp_;  // the other hosts' ranks
  std::atomic<bool> stop_{false};
  std::thread watcher_;
  std::unique_ptr<P2PEngine> engine_;
  std::atomic<P2PEngine*> published_{nullptr};  // engine_ once stored (see ShmTransport::engine_)
};

}  // namespace torchpar
