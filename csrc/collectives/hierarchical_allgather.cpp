// all_gather across hosts (issue 21; hierarchical.h): within each host through its arena,
// then the hosts' leaders exchange their hosts' blocks, then each leader broadcasts the other
// hosts' blocks within its host.
#include <cstring>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/p2p/exchange.h"
#include "common/error.h"

namespace torchpar::collectives::hier {

void allgather(Comm& c, const void* in, void* const* outs, size_t count, c10::ScalarType dtype) {
  const Hierarchy& h = *c.hierarchy;
  const HostMap& map = h.map;
  const std::vector<int>& mine = h.local_ranks();
  const auto desc = op_desc(OpKind::kAllgather, dtype, count);
  std::string message = agree(c, desc);
  if (!message.empty()) throw UsageError(message);
  const size_t bytes = count * element_size(dtype);

  // This host's blocks, on every rank of it.
  if (h.arena != nullptr) {
    Comm host = host_comm(c);
    std::vector<void*> host_outs(mine.size());
    for (size_t i = 0; i < mine.size(); ++i) host_outs[i] = outs[mine[i]];
    collectives::allgather(host, in, host_outs.data(), count, dtype);
  } else if (bytes && outs[c.rank()] != in) {
    std::memmove(outs[c.rank()], in, bytes);
  }

  // Leader to leader: one message per block (a rank's output blocks need not be adjacent).
  if (h.leader()) {
    Comm leaders = leaders_comm(c);
    p2p::Exchange ex(leaders);
    for (int g = 0; g < map.hosts(); ++g) {
      if (g == h.host()) continue;
      for (size_t i = 0; i < map.ranks_of[g].size(); ++i) {
        ex.recv(g, p2p::Phase::kHosts, static_cast<uint32_t>(i), outs[map.ranks_of[g][i]], bytes);
      }
    }
    p2p::agree(leaders, desc, &ex);  // every leader's receives are posted (hosts_comm)
    for (int g = 0; g < map.hosts(); ++g) {
      if (g == h.host()) continue;
      for (size_t i = 0; i < mine.size(); ++i) {
        ex.send(g, p2p::Phase::kHosts, static_cast<uint32_t>(i), outs[mine[i]], bytes);
      }
    }
    ex.wait_all();
  }

  // The other hosts' blocks, from the leader to the rest of its host.
  if (h.arena != nullptr) {
    Segments theirs;
    for (int r = 0; r < c.size(); ++r) {
      if (!map.same_host(r, c.rank())) theirs.add(outs[r], bytes);
    }
    Comm host = host_comm(c);
    collectives::broadcast(host, theirs, (c.size() - mine.size()) * count, dtype, /*root=*/0);
  }
}

}  // namespace torchpar::collectives::hier
