// Shared-memory transport for a group whose ranks all live on one host: one segment per
// group holds the collective arena and a point-to-point ring per ordered pair of ranks.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "common/env.h"
#include "transport/link.h"
#include "transport/p2p_engine.h"
#include "transport/rendezvous.h"
#include "transport/transport.h"
#include "transport/shm/arena.h"
#include "transport/shm/monitor.h"
#include "transport/shm/ring.h"
#include "transport/shm/segment.h"

namespace torchpar::shm {

class ShmTransport final : public Transport {
 public:
  // Collective over the group: every rank constructs its transport with the same
  // rendezvous; returns once all ranks have mapped the segment (and it is unlinked).
  // Without `own_engine` it starts no point-to-point engine: a transport spanning hosts
  // (mixed_transport.h) drives its rings from the engine of the whole group, and names its
  // ranks in errors by `group_ranks` (their ranks in that group).
  ShmTransport(int rank, int size, Rendezvous& rendezvous, const Config& config,
               std::chrono::milliseconds timeout, bool own_engine = true, std::vector<int> group_ranks = {});
  ~ShmTransport() override;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const char* name() const override { return "shm"; }
  Arena* arena() override { return &arena_; }
  P2PEngine& p2p() override;
  const Monitor& monitor() const { return monitor_; }
  const std::string& segment_name() const { return segment_.name(); }

  void abort(const std::string& reason) override;
  void leave() override { monitor_.leave(); }

  // Link
  size_t write_some(int peer, const void* data, size_t n) override;
  size_t read_some(int peer, void* data, size_t n) override;
  void notify(int peer) override;
  uint32_t activity() const override;
  void sleep_until_activity(uint32_t seen, std::chrono::microseconds max_sleep) override;
  void check_peer(int peer) override;
  bool writable_from_any_thread(int) const override { return true; }

 private:
  void map_segment(Rendezvous& rendezvous, const Config& config, std::chrono::milliseconds timeout,
                   std::vector<int> group_ranks);

  const int rank_;
  const int size_;
  Segment segment_;
  SegmentHeader* header_ = nullptr;
  RankBlock* blocks_ = nullptr;
  std::vector<Ring> send_rings_;  // [peer]: this rank -> peer
  std::vector<Ring> recv_rings_;  // [peer]: peer -> this rank
  Monitor monitor_;
  Arena arena_;
  std::unique_ptr<P2PEngine> p2p_;
  // p2p_ once the constructor has stored it. The engine's thread runs from inside its own
  // constructor and may abort() on a bad frame at once; abort() reads this, not p2p_, which
  // the constructing thread may still be writing (the engine fails itself in that case).
  std::atomic<P2PEngine*> engine_{nullptr};
};

}  // namespace torchpar::shm
