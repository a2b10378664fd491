// Watches the health of a same-host group: a rank that fails publishes the reason in the
// segment, so every live peer stops at once with that reason; a peer whose process is gone
// is noticed from its pid instead of at the timeout.
#pragma once

#include <string>
#include <vector>

#include "transport/shm/layout.h"

namespace torchpar::shm {

class Monitor {
 public:
  Monitor() = default;
  Monitor(int rank, SegmentHeader* header, RankBlock* blocks, int size)
      : rank_(rank), header_(header), blocks_(blocks), size_(size) {}

  // Throws torchpar::Error if the group was aborted or `peer`'s process has exited.
  void check(int peer) const;
  // Throws if the group was aborted by any rank.
  void check_aborted() const;
  // Records the first failure of the group for every rank and wakes all their waits.
  void abort(const std::string& reason);

 private:
  int rank_ = 0;
  SegmentHeader* header_ = nullptr;
  RankBlock* blocks_ = nullptr;
  int size_ = 0;
};

// Whether process `pid` exists and is not a zombie.
bool process_alive(int pid);

}  // namespace torchpar::shm
