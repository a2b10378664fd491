// Which ranks of a group share a host, and what a group spanning hosts holds for its
// hierarchical collectives (issue 21): the ranks of each host share memory, one leader per
// host talks to the other hosts.
#pragma once

#include <string>
#include <vector>

#include "transport/records.h"

namespace torchpar {

namespace shm {
class Arena;
}

// Hosts are numbered in the order of their lowest rank; a host's ranks are listed in
// ascending order, and its leader is the first of them. Ranks of one host need not be
// contiguous (torchrun's node ranks can interleave).
struct HostMap {
  std::vector<int> host_of;                // [rank]: its host
  std::vector<int> local_rank;             // [rank]: its index among its host's ranks
  std::vector<std::vector<int>> ranks_of;  // [host]: its ranks, ascending
  std::vector<int> leaders;                // [host]: its lowest rank

  // From any labels that tell hosts apart (equal label: same host), one per rank.
  template <typename Label>
  static HostMap from(const std::vector<Label>& labels) {
    HostMap m;
    std::vector<const Label*> seen;
    for (size_t r = 0; r < labels.size(); ++r) {
      size_t h = 0;
      while (h < seen.size() && !(*seen[h] == labels[r])) ++h;
      if (h == seen.size()) {
        seen.push_back(&labels[r]);
        m.ranks_of.emplace_back();
        m.leaders.push_back(static_cast<int>(r));
      }
      m.host_of.push_back(static_cast<int>(h));
      m.local_rank.push_back(static_cast<int>(m.ranks_of[h].size()));
      m.ranks_of[h].push_back(static_cast<int>(r));
    }
    return m;
  }
  int hosts() const { return static_cast<int>(ranks_of.size()); }
  bool same_host(int a, int b) const { return host_of[a] == host_of[b]; }
  // "host 1 (ranks 2, 3)", for error messages.
  std::string describe(int host) const;
};

// What the collectives of a group spanning hosts use besides the point-to-point engine:
// the host map and this host's arena (null when the rank is alone on its host).
struct Hierarchy {
  HostMap map;
  int rank = 0;
  shm::Arena* arena = nullptr;

  int host() const { return map.host_of[rank]; }
  const std::vector<int>& local_ranks() const { return map.ranks_of[host()]; }
  int local_rank() const { return map.local_rank[rank]; }
  bool leader() const { return local_rank() == 0; }
};

}  // namespace torchpar
