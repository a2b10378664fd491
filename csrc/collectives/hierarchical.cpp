#include "collectives/hierarchical.h"

#include <cstring>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/p2p/exchange.h"
#include "common/error.h"

namespace torchpar::collectives::hier {
namespace {

// This host's ranks, over its arena.
Comm host_comm(const Comm& c) {
  const Hierarchy& h = *c.hierarchy;
  Comm host{h.arena, c.p2p, c.config, c.deadline, c.seq, c.busy_wait, c.scratch};
  host.members = &h.local_ranks();
  host.member_rank = h.local_rank();
  return host;
}

// One rank per host (its leader), over point-to-point messages; rank g is host g's leader.
// Descriptors were checked by agree() already, but the leaders' algorithms still run their
// own (small) agreement: it is what makes them post their receives before any leader sends.
// Without it a leader done with its host early sent its chunks to leaders still reducing
// theirs, as early arrivals: extra copies, and a group failed past
// TORCHPAR_UNEXPECTED_MAX_BYTES (review finding).
Comm leaders_comm(const Comm& c) {
  const Hierarchy& h = *c.hierarchy;
  Comm leaders{nullptr, c.p2p, c.config, c.deadline, c.seq, c.busy_wait, c.scratch};
  leaders.members = &h.map.leaders;
  leaders.member_rank = h.host();
  return leaders;
}

// Within this host, from local rank `root` to the others (a no-op for a rank alone).
void host_broadcast(Comm& c, const Segments& data, size_t count, c10::ScalarType dtype, int root) {
  if (c.hierarchy->arena == nullptr) return;
  Comm host = host_comm(c);
  collectives::broadcast(host, data, count, dtype, root);
}

}  // namespace

std::string agree(Comm& c, const shm::OpDesc& desc) {
  const Hierarchy& h = *c.hierarchy;
  const HostMap& map = h.map;
  const std::vector<int>& mine = h.local_ranks();
  const bool shared = h.arena != nullptr;
  Comm host = host_comm(c);
  std::vector<shm::OpDesc> table(c.size());
  if (shared) {
    host.begin(desc);
    host.arrive_and_wait();  // every rank of this host has published its descriptor
  }
  if (h.leader()) {
    std::vector<shm::OpDesc> ours(mine.size());
    for (size_t i = 0; i < mine.size(); ++i) ours[i] = shared ? host.arena().desc(static_cast<int>(i)) : desc;
    std::vector<std::vector<shm::OpDesc>> theirs(map.hosts());
    Comm leaders = leaders_comm(c);
    p2p::Exchange ex(leaders);
    for (int g = 0; g < map.hosts(); ++g) {
      if (g == h.host()) continue;
      theirs[g].resize(map.ranks_of[g].size());
      ex.recv(g, p2p::Phase::kHosts, 0, theirs[g].data(), theirs[g].size() * sizeof(shm::OpDesc));
    }
    for (int g = 0; g < map.hosts(); ++g) {
      if (g != h.host()) ex.send(g, p2p::Phase::kHosts, 0, ours.data(), ours.size() * sizeof(shm::OpDesc));
    }
    ex.wait_all();
    theirs[h.host()] = std::move(ours);
    for (int g = 0; g < map.hosts(); ++g) {
      for (size_t i = 0; i < map.ranks_of[g].size(); ++i) table[map.ranks_of[g][i]] = theirs[g][i];
    }
  }
  if (shared) {
    // The leader hands the table to its host in its slot (MixedTransport checked it fits).
    const size_t bytes = table.size() * sizeof(shm::OpDesc);
    if (h.leader()) {
      std::memcpy(host.arena().slot(0), table.data(), bytes);
      host.arrive();
    } else {
      host.arrive();
      host.wait_for(0);
      std::memcpy(table.data(), host.arena().slot(0), bytes);
    }
    host.arrive();  // done reading the slot
  }
  return mismatch(table, c.seq);
}

void allreduce(Comm& c, const Segments& data, size_t count, c10::ScalarType dtype, ReduceOp op) {
  const Hierarchy& h = *c.hierarchy;
  const size_t es = element_size(dtype);
  const auto desc = op_desc(OpKind::kAllreduce, dtype, count, 0, static_cast<int>(op));
  std::string message = agree(c, desc);
  if (!message.empty()) throw UsageError(message);
  // AVG: sums all the way, then one division by the group's size on each leader.
  const ReduceOp partial = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  if (h.arena != nullptr) {
    Comm host = host_comm(c);
    host.begin(op_desc(OpKind::kReduce, dtype, count, 0, static_cast<int>(partial)));
    reduce_in_chunks(host, data, count, dtype, partial, /*root=*/0);
  }
  if (h.leader()) {
    Comm leaders = leaders_comm(c);
    p2p::allreduce(leaders, data, count, dtype, partial);
    if (op == ReduceOp::kAvg) {
      data.for_each(0, count * es, [&](char* at, size_t, size_t bytes) {
        const void* src = at;
        reduce(dtype, ReduceOp::kAvg, at, &src, 1, bytes / es, c.size());
      });
    }
  }
  host_broadcast(c, data, count, dtype, 0);
}

void broadcast(Comm& c, void* data, size_t count, c10::ScalarType dtype, int root) {
  const Hierarchy& h = *c.hierarchy;
  std::string message = agree(c, op_desc(OpKind::kBroadcast, dtype, count, root));
  if (!message.empty()) throw UsageError(message);
  const Segments buffer(data, count * element_size(dtype));
  const int root_host = h.map.host_of[root];
  if (h.host() == root_host) host_broadcast(c, buffer, count, dtype, h.map.local_rank[root]);
  if (h.leader()) {
    Comm leaders = leaders_comm(c);
    p2p::broadcast(leaders, data, count, dtype, root_host);
  }
  if (h.host() != root_host) host_broadcast(c, buffer, count, dtype, 0);
}

}  // namespace torchpar::collectives::hier
