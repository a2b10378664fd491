#include "collectives/hierarchical.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/hierarchical_pipeline.h"
#include "collectives/p2p/exchange.h"
#include "common/error.h"

namespace torchpar::collectives::hier {

Comm host_comm(const Comm& c) {
  const Hierarchy& h = *c.hierarchy;
  Comm host{h.arena, c.p2p, c.config, c.deadline, c.seq, c.busy_wait, c.scratch};
  host.members = &h.local_ranks();
  host.member_rank = h.local_rank();
  return host;
}

// Descriptors were checked by agree() already, but the algorithms among hosts still run
// their own (small) agreement: it is what makes them post their receives before any of them
// sends. Without it a leader done with its host early sent its chunks to leaders still
// reducing theirs, as early arrivals: extra copies, and a group failed past
// TORCHPAR_UNEXPECTED_MAX_BYTES (review finding). (The rails skip it for calls that receive
// little: kRailAgreeAboveBytes.)
//
// The ranks among hosts (leaders, or a rail) give up a little before their hosts' other
// ranks' arena waits (1/16 of the time left, at most 2 s): a rank whose peer on another host
// went silent (its link down: no FIN, no RST) then times out first, naming that peer, and
// aborts its host's arena with that reason, so its host's other ranks, which only waited for
// it, report the silent host's rank too rather than their own host's (issue 21).
Comm hosts_comm(const Comm& c, const std::vector<int>& ranks) {
  const Hierarchy& h = *c.hierarchy;
  const auto left = c.deadline - Clock::now();
  const auto early = std::min<Clock::duration>(std::max<Clock::duration>(left / 16, Clock::duration::zero()),
                                               std::chrono::seconds(2));
  Comm hosts{nullptr, c.p2p, c.config, c.deadline - early, c.seq, c.busy_wait, c.scratch};
  hosts.members = &ranks;
  hosts.member_rank = h.host();
  return hosts;
}

Comm leaders_comm(const Comm& c) { return hosts_comm(c, c.hierarchy->map.leaders); }

size_t pipeline_chunk(const Comm& c, c10::ScalarType dtype, size_t count, size_t blocks) {
  const size_t es = element_size(dtype);
  const size_t slot = std::max<size_t>(16, static_cast<size_t>(c.config.slot_bytes) / es / 16 * 16);
  const size_t total = count * blocks;
  if (blocks == 0 || total <= 2 * slot) return 0;
  // All blocks' share of a chunk: more than total / kPipelineChunks, and a slot at least.
  const size_t all = std::max(slot, (total + kPipelineChunks - 1) / kPipelineChunks / 16 * 16 + 16);
  return ((all + blocks - 1) / blocks + 15) / 16 * 16;
}

Segments slice(const Segments& s, size_t begin, size_t bytes) {
  Segments out;
  s.for_each(begin, bytes, [&](char* p, size_t, size_t n) { out.add(p, n); });
  return out;
}

bool even_hosts(const HostMap& map) {
  for (const auto& ranks : map.ranks_of) {
    if (ranks.size() < 2 || ranks.size() != map.ranks_of[0].size()) return false;
  }
  return true;
}

std::vector<int> rail_of(const Hierarchy& h) {
  std::vector<int> rail;
  for (const auto& ranks : h.map.ranks_of) rail.push_back(ranks[h.local_rank()]);
  return rail;
}

bool reduces_flat(c10::ScalarType dtype, ReduceOp op) {
  return dtype == c10::kHalf && (op == ReduceOp::kSum || op == ReduceOp::kAvg || op == ReduceOp::kProduct);
}

namespace {

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
