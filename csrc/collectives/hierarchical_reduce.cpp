// reduce_scatter and reduce across hosts (issue 21; hierarchical.h): reduce within each host
// through its arena, send each host's partial sums to the rank (the host's leader, or the
// root) that needs them, add the hosts' partials in host order there, and (reduce_scatter)
// scatter the results within each host. AVG sums all the way and divides once at the end.
#include <cstring>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/p2p/exchange.h"
#include "common/error.h"

namespace torchpar::collectives::hier {
namespace {

// dst = the hosts' partials (srcs, in host order) reduced with `op`; for AVG summed, then
// divided by the group's size, as hier::allreduce does (so the results equal its bits).
void add_hosts(Comm& c, c10::ScalarType dtype, ReduceOp op, char* dst, const std::vector<const void*>& srcs,
               size_t count) {
  const int hosts = static_cast<int>(srcs.size());
  collectives::reduce(dtype, op == ReduceOp::kAvg ? ReduceOp::kSum : op, dst, srcs.data(), hosts, count, hosts);
  if (op == ReduceOp::kAvg && count > 0) {
    const void* src = dst;
    collectives::reduce(dtype, ReduceOp::kAvg, dst, &src, 1, count, c.size());
  }
}

}  // namespace

void reduce_scatter(Comm& c, const void* const* ins, void* out, size_t count, c10::ScalarType dtype,
                    ReduceOp op) {
  const Hierarchy& h = *c.hierarchy;
  const HostMap& map = h.map;
  const std::vector<int>& mine = h.local_ranks();
  const int w = c.size(), hosts = map.hosts(), me = h.host();
  const size_t local = mine.size(), es = element_size(dtype), bytes = count * es;
  const auto desc = op_desc(OpKind::kReduceScatter, dtype, count, 0, static_cast<int>(op));
  std::string message = agree(c, desc);
  if (!message.empty()) throw UsageError(message);
  const ReduceOp partial = op == ReduceOp::kAvg ? ReduceOp::kSum : op;

  // The leader's staging, taken once (staging() may move it when it grows): this host's
  // partial of every rank's block and the results for its ranks (when the host has several
  // ranks; a rank alone reads its inputs and writes its output in place), and the other
  // hosts' partials of this host's blocks ([host][local rank]).
  const bool shared = h.arena != nullptr;
  char* partials = nullptr;
  char* incoming = nullptr;
  char* results = nullptr;
  if (h.leader()) {
    const size_t own = shared ? (static_cast<size_t>(w) + local) * bytes : 0;
    partials = c.staging(own + static_cast<size_t>(hosts - 1) * local * bytes);
    results = partials + static_cast<size_t>(w) * bytes;
    incoming = partials + own;
  }
  auto partial_of = [&](int r) -> const char* {
    return shared ? partials + r * bytes : static_cast<const char*>(ins[r]);
  };
  auto from = [&](int g, size_t i) { return incoming + ((g - (g > me)) * local + i) * bytes; };

  // Within the host, every rank's block reduced into the leader's copy; the other ranks'
  // inputs are only read (reduce_in_chunks leaves non-receivers' buffers unchanged).
  if (shared) {
    Segments data;
    for (int r = 0; r < w; ++r) {
      if (h.leader() && bytes) std::memcpy(partials + r * bytes, ins[r], bytes);
      data.add(h.leader() ? partials + r * bytes : const_cast<void*>(ins[r]), bytes);
    }
    Comm host = host_comm(c);
    host.begin(op_desc(OpKind::kReduce, dtype, static_cast<uint64_t>(w) * count, 0, static_cast<int>(partial)));
    reduce_in_chunks(host, data, static_cast<size_t>(w) * count, dtype, partial, /*root=*/0);
  }

  if (h.leader()) {
    // Each host's partials of host g's blocks go to g's leader.
    Comm leaders = leaders_comm(c);
    p2p::Exchange ex(leaders);
    for (int g = 0; g < hosts; ++g) {
      if (g == me) continue;
      for (size_t i = 0; i < local; ++i) ex.recv(g, p2p::Phase::kHosts, static_cast<uint32_t>(i), from(g, i), bytes);
    }
    p2p::agree(leaders, desc, &ex);  // every leader's receives are posted (hosts_comm)
    for (int g = 0; g < hosts; ++g) {
      if (g == me) continue;
      for (size_t i = 0; i < map.ranks_of[g].size(); ++i) {
        ex.send(g, p2p::Phase::kHosts, static_cast<uint32_t>(i), partial_of(map.ranks_of[g][i]), bytes);
      }
    }
    ex.wait_all();
    std::vector<const void*> srcs(hosts);
    for (size_t i = 0; i < local; ++i) {
      for (int g = 0; g < hosts; ++g) srcs[g] = g == me ? partial_of(mine[i]) : from(g, i);
      add_hosts(c, dtype, op, shared ? results + i * bytes : static_cast<char*>(out), srcs, count);
    }
  }

  if (shared) {
    std::vector<const void*> pieces(local, nullptr);
    for (size_t i = 0; h.leader() && i < local; ++i) pieces[i] = results + i * bytes;
    Comm host = host_comm(c);
    collectives::scatter(host, pieces.data(), out, count, dtype, /*root=*/0);
  }
}

void reduce(Comm& c, void* data, size_t count, c10::ScalarType dtype, ReduceOp op, int root) {
  const Hierarchy& h = *c.hierarchy;
  const HostMap& map = h.map;
  const int hosts = map.hosts(), me = h.host(), root_host = map.host_of[root];
  const size_t es = element_size(dtype), bytes = count * es;
  const auto desc = op_desc(OpKind::kReduce, dtype, count, root, static_cast<int>(op));
  std::string message = agree(c, desc);
  if (!message.empty()) throw UsageError(message);
  const ReduceOp partial = op == ReduceOp::kAvg ? ReduceOp::kSum : op;

  // One rank per host holds its host's partial: the root on its host, the leader elsewhere.
  std::vector<int> holders = map.leaders;
  holders[root_host] = root;
  const bool holder = holders[me] == c.rank();
  const bool is_root = c.rank() == root;
  const bool shared = h.arena != nullptr;
  // A holder other than the root reduces into a copy: its own data must stay unchanged. The
  // root receives the other hosts' partials beside it.
  char* staged = nullptr;
  if (holder && !is_root && shared) {
    staged = c.staging(bytes);
    if (bytes) std::memcpy(staged, data, bytes);
  } else if (is_root) {
    staged = c.staging(static_cast<size_t>(hosts - 1) * bytes);
  }
  char* mine = holder && !is_root && shared ? staged : static_cast<char*>(data);

  if (shared) {
    Comm host = host_comm(c);
    const int local_root = map.local_rank[holders[me]];
    host.begin(op_desc(OpKind::kReduce, dtype, count, local_root, static_cast<int>(partial)));
    reduce_in_chunks(host, Segments(holder ? mine : data, bytes), count, dtype, partial, local_root);
  }

  if (holder) {
    Comm among = hosts_comm(c, holders);
    p2p::Exchange ex(among);
    auto from = [&](int g) { return staged + (g - (g > root_host)) * bytes; };
    for (int g = 0; is_root && g < hosts; ++g) {
      if (g != root_host) ex.recv(g, p2p::Phase::kHosts, 0, from(g), bytes);
    }
    p2p::agree(among, desc, &ex);  // the root's receives are posted
    if (!is_root) ex.send(root_host, p2p::Phase::kHosts, 0, mine, bytes);
    ex.wait_all();
    if (is_root) {
      std::vector<const void*> srcs(hosts);
      for (int g = 0; g < hosts; ++g) srcs[g] = g == root_host ? static_cast<const void*>(data) : from(g);
      add_hosts(c, dtype, op, static_cast<char*>(data), srcs, count);
    }
  }
}

}  // namespace torchpar::collectives::hier
