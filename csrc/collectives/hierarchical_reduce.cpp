// reduce_scatter and reduce across hosts (issue 21; hierarchical.h). AVG sums all the way
// and divides once at the end.
//
// reduce: within each host through its arena to one rank (the root, or its host's leader),
// the hosts' partials to the root, added there in host order.
//
// reduce_scatter, when every host has the same number of ranks L (two or more), by rails:
// local rank l of every host forms rail l. A reduce-scatter inside each host leaves local
// rank l with its host's partial of the blocks of rail l (one per host); it sends each to
// that block's owner, its peer on the same rail, and adds the hosts' partials of its own
// block in host order. Every rank of every host reduces, sends and receives a 1/L share:
// through one leader per host (below), the leader copied every rank's input and reduced and
// scattered the whole host's share itself, and on a link that is not the bottleneck that was
// 0.63-0.80x of the flat algorithm's speed (docs/hosts.md).
//
// Otherwise (hosts of unequal sizes) through the leaders: reduce every rank's block into the
// host's leader, send each host's partials to that host's leader, add the hosts' partials in
// host order there, and scatter the results within each host.
//
// Both run beyond two arena slots as a pipeline over chunks of the blocks
// (hierarchical_pipeline.h; chunk k is elements [k x chunk, (k + 1) x chunk) of every rank's
// block), as all_reduce does: while the link carries chunk k, the host reduces chunk k + 1
// (and adds, or scatters, chunk k - 1). The hosts' ranks are summed in rank order inside the
// host, the hosts' partials in host order: the bits of all_reduce either way.
#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/hierarchical_pipeline.h"
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

void reduce_scatter_by_rails(Comm& c, const void* const* ins, void* out, size_t count, c10::ScalarType dtype,
                             ReduceOp op, const shm::OpDesc& desc) {
  const Hierarchy& h = *c.hierarchy;
  const HostMap& map = h.map;
  const int hosts = map.hosts(), me = h.host();
  const size_t local = h.local_ranks().size(), es = element_size(dtype), bytes = count * es;
  const ReduceOp partial = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  size_t chunk = pipeline_chunk(c, dtype, count, static_cast<size_t>(c.size()));
  if (chunk == 0) chunk = std::max<size_t>(count, 1);
  const size_t chunks = p2p::chunks_of(count, chunk);

  // This rank's staging, taken once (staging() may move it when it grows): its host's
  // partials of its rail's blocks ([host]), then the other hosts' partials of its own.
  char* partials = c.staging(static_cast<size_t>(2 * hosts - 1) * bytes);
  char* incoming = partials + static_cast<size_t>(hosts) * bytes;
  auto from = [&](int g) { return incoming + (g - (g > me)) * bytes; };

  const std::vector<int> rail = rail_of(h);
  Comm host = host_comm(c);
  Comm peers = hosts_comm(c, rail);
  p2p::Exchange ex(peers);
  // Every chunk's receives, before any peer sends (when large: hosts_comm): the other hosts'
  // partials of this rank's block.
  std::vector<std::vector<p2p::Exchange::Handle>> arrived(chunks);
  for (size_t k = 0; k < chunks; ++k) {
    const Piece s = chunk_span(k, chunk, count);
    for (int g = 0; g < hosts; ++g) {
      if (g != me) arrived[k].push_back(ex.recv(g, p2p::Phase::kScatter, static_cast<uint32_t>(k), from(g) + s.begin * es, s.size() * es));
    }
  }
  if (rail_agrees(chunks, hosts, bytes)) p2p::agree(peers, desc, &ex);

  std::vector<const void*> ins_of_host(local), srcs(hosts);
  for (size_t k = 0; k < chunks + 1; ++k) {
    if (k < chunks) {
      const Piece s = chunk_span(k, chunk, count);
      const size_t off = s.begin * es, n = s.size() * es;
      // The other hosts' blocks first, so that their chunk leaves while this host goes on.
      for (int i = 1; i <= hosts; ++i) {
        const int g = (me + i) % hosts;
        for (size_t q = 0; q < local; ++q) ins_of_host[q] = static_cast<const char*>(ins[map.ranks_of[g][q]]) + off;
        char* sum = partials + g * bytes + off;
        collectives::reduce_scatter(host, ins_of_host.data(), sum, s.size(), dtype, partial);
        if (g != me) ex.send(g, p2p::Phase::kScatter, static_cast<uint32_t>(k), sum, n);
      }
    }
    if (k >= 1) {  // chunk k-1 of this rank's block: the hosts' partials added in host order
      const Piece s = chunk_span(k - 1, chunk, count);
      const size_t off = s.begin * es;
      for (auto& handle : arrived[k - 1]) ex.wait(handle);
      for (int g = 0; g < hosts; ++g) srcs[g] = (g == me ? partials + g * bytes : from(g)) + off;
      add_hosts(c, dtype, op, static_cast<char*>(out) + off, srcs, s.size());
    }
  }
  ex.wait_all();
}

void reduce_scatter_through_leaders(Comm& c, const void* const* ins, void* out, size_t count,
                                    c10::ScalarType dtype, ReduceOp op, const shm::OpDesc& desc) {
  const Hierarchy& h = *c.hierarchy;
  const HostMap& map = h.map;
  const std::vector<int>& mine = h.local_ranks();
  const int w = c.size(), hosts = map.hosts(), me = h.host();
  const size_t local = mine.size(), es = element_size(dtype), bytes = count * es;
  const ReduceOp partial = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  // The stages in one go (chunk = count) up to two slots; else in chunks of every block.
  size_t chunk = pipeline_chunk(c, dtype, count, static_cast<size_t>(w));
  if (chunk == 0) chunk = std::max<size_t>(count, 1);
  const size_t chunks = p2p::chunks_of(count, chunk);

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
  auto result = [&](size_t i) { return shared ? results + i * bytes : static_cast<char*>(out); };

  Comm host = host_comm(c);
  Comm leaders = leaders_comm(c);
  p2p::Exchange ex(leaders);
  // Chunk k of every host's partial of this host's block i arrives as message k x local + i.
  std::vector<std::vector<p2p::Exchange::Handle>> arrived(chunks);
  auto post_receives = [&] {  // every chunk's, before any leader sends (hosts_comm)
    for (size_t k = 0; k < chunks; ++k) {
      const Piece s = chunk_span(k, chunk, count);
      for (int g = 0; g < hosts; ++g) {
        for (size_t i = 0; g != me && i < local; ++i) {
          arrived[k].push_back(ex.recv(g, p2p::Phase::kScatter, static_cast<uint32_t>(k * local + i),
                                       from(g, i) + s.begin * es, s.size() * es));
        }
      }
    }
    p2p::agree(leaders, desc, &ex);
  };

  std::vector<const void*> srcs(hosts);
  std::vector<const void*> pieces(local, nullptr);
  for (size_t k = 0; k < chunks + 1; ++k) {
    if (k < chunks) {
      const Piece s = chunk_span(k, chunk, count);
      const size_t off = s.begin * es, n = s.size() * es;
      // Within the host, chunk k of every rank's block reduced into the leader's copy; the
      // other ranks' inputs are only read (reduce_in_chunks leaves non-receivers' buffers
      // unchanged).
      if (shared) {
        Segments data;
        for (int r = 0; r < w; ++r) {
          char* copy = h.leader() ? partials + r * bytes + off : nullptr;
          if (copy) std::memcpy(copy, static_cast<const char*>(ins[r]) + off, n);
          data.add(copy ? copy : const_cast<char*>(static_cast<const char*>(ins[r]) + off), n);
        }
        host.begin(op_desc(OpKind::kReduce, dtype, static_cast<uint64_t>(w) * s.size(), 0, static_cast<int>(partial)));
        reduce_in_chunks(host, data, static_cast<size_t>(w) * s.size(), dtype, partial, /*root=*/0);
      }
      if (h.leader() && k == 0) post_receives();
      // This host's partials of host g's blocks go to g's leader.
      for (int g = 0; h.leader() && g < hosts; ++g) {
        const size_t n_g = map.ranks_of[g].size();
        for (size_t i = 0; g != me && i < n_g; ++i) {
          ex.send(g, p2p::Phase::kScatter, static_cast<uint32_t>(k * n_g + i), partial_of(map.ranks_of[g][i]) + off, n);
        }
      }
    }
    if (k >= 1) {  // chunk k-1: the hosts' partials added in host order, scattered within the host
      const Piece s = chunk_span(k - 1, chunk, count);
      const size_t off = s.begin * es;
      if (h.leader()) {
        for (auto& handle : arrived[k - 1]) ex.wait(handle);
        for (size_t i = 0; i < local; ++i) {
          for (int g = 0; g < hosts; ++g) srcs[g] = g == me ? partial_of(mine[i]) + off : from(g, i) + off;
          add_hosts(c, dtype, op, result(i) + off, srcs, s.size());
          pieces[i] = result(i) + off;
        }
      }
      if (shared) collectives::scatter(host, pieces.data(), static_cast<char*>(out) + off, s.size(), dtype, /*root=*/0);
    }
  }
  ex.wait_all();
}

}  // namespace

void reduce_scatter(Comm& c, const void* const* ins, void* out, size_t count, c10::ScalarType dtype,
                    ReduceOp op) {
  const auto desc = op_desc(OpKind::kReduceScatter, dtype, count, 0, static_cast<int>(op));
  std::string message = agree(c, desc);
  if (!message.empty()) throw UsageError(message);
  if (even_hosts(c.hierarchy->map)) return reduce_scatter_by_rails(c, ins, out, count, dtype, op, desc);
  reduce_scatter_through_leaders(c, ins, out, count, dtype, op, desc);
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
