// The collective arena: one slot per rank in shared memory. Rank r writes only slot r;
// every rank may read every slot, so collective algorithms reduce and copy straight from
// their peers' data with no intermediate hop.
//
// Ranks move through collectives in lock step by publishing a generation counter (step)
// and waiting for their peers' counters. Counters only grow; a rank never rewrites its
// slot before every peer has passed the step in which it last read it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

#include "transport/request.h"
#include "transport/shm/layout.h"
#include "transport/shm/monitor.h"

namespace torchpar::shm {

class Arena {
 public:
  Arena() = default;
  Arena(int rank, int size, RankBlock* blocks, char* slots, size_t slot_bytes,
        const Monitor* monitor, std::chrono::microseconds spin, std::chrono::microseconds yield)
      : rank_(rank), size_(size), blocks_(blocks), slots_(slots), slot_bytes_(slot_bytes),
        monitor_(monitor), spin_(spin), yield_(yield) {}

  int rank() const { return rank_; }
  int size() const { return size_; }
  size_t slot_bytes() const { return slot_bytes_; }
  char* slot(int r) const { return slots_ + static_cast<size_t>(r) * slot_bytes_; }
  OpDesc& desc(int r) const { return blocks_[r].desc; }

  // This rank's current step.
  uint32_t step() const { return step_; }
  // Moves this rank to the next step and tells its peers; returns the new step.
  uint32_t arrive();
  // Waits until `peer` has reached `target`. A busy wait spins and yields the CPU for a
  // while before sleeping (lowest latency); otherwise it sleeps at once, leaving the CPU to
  // whatever the process computes meanwhile.
  void wait_peer(int peer, uint32_t target, Clock::time_point deadline, bool busy = true) const;
  // Waits until every other rank has reached `target`.
  void wait_all(uint32_t target, Clock::time_point deadline, bool busy = true) const;

 private:
  int rank_ = 0;
  int size_ = 0;
  RankBlock* blocks_ = nullptr;
  char* slots_ = nullptr;
  size_t slot_bytes_ = 0;
  const Monitor* monitor_ = nullptr;
  std::chrono::microseconds spin_{0};
  std::chrono::microseconds yield_{0};
  uint32_t step_ = 0;
};

}  // namespace torchpar::shm
