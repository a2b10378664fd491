// Watches the health of a same-host group: a rank that fails publishes the reason in the
// segment, so every live peer stops at once with that reason; a peer whose process is gone
// is noticed from its pid instead of at the timeout.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "transport/shm/layout.h"

namespace torchpar::shm {

class Monitor {
 public:
  Monitor() = default;
  // `names`: the rank each member is known by in errors ([member]; empty: its index). The
  // ranks of one host in a group spanning hosts are named by their ranks in the group.
  Monitor(int rank, SegmentHeader* header, RankBlock* blocks, int size, std::vector<int> names = {})
      : rank_(rank), header_(header), blocks_(blocks), size_(size), names_(std::move(names)) {}

  // How member `r` is named in errors.
  int name(int r) const { return names_.empty() ? r : names_[r]; }

  // Throws torchpar::Error if the group was aborted, or `peer`'s process has exited or left
  // the group.
  void check(int peer) const;
  // Marks this rank's side of the group as gone (its transport is closing) and wakes every
  // peer's waits, so that one still waiting for this rank fails at its next check.
  void leave();
  // Throws if the group was aborted by any rank.
  void check_aborted() const;
  // Records the first failure of the group for every rank and wakes all their waits.
  void abort(const std::string& reason);

 private:
  int rank_ = 0;
  SegmentHeader* header_ = nullptr;
  RankBlock* blocks_ = nullptr;
  int size_ = 0;
  std::vector<int> names_;
};

// Whether process `pid` exists and is not a zombie.
bool process_alive(int pid);

}  // namespace torchpar::shm
