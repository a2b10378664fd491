// all_gather across hosts (issue 21; hierarchical.h).
//
// When every host has the same number of ranks L (two or more), by rails (as reduce_scatter,
// hierarchical_reduce.cpp): local rank l of every host forms rail l. Each rank sends its block
// to its peers on the rail, then the host all-gathers, block by block, its own ranks' blocks
// and those its ranks received: every rank sends and receives a 1/L share, and its block
// leaves at once, before any work inside the host.
//
// Otherwise (hosts of unequal sizes) through the leaders: within each host through its arena,
// then the hosts' leaders exchange their hosts' blocks, then each leader broadcasts the other
// hosts' blocks within its host.
//
// Beyond two arena slots both run as a pipeline over chunks of the blocks
// (hierarchical_pipeline.h: chunk k is elements [k x chunk, (k + 1) x chunk) of every rank's
// block): while the link carries chunk k, the host gathers chunk k + 1 (by leaders; chunk k
// by rails) and spreads chunk k - 1. One after the other, the stages inside the hosts left a
// 64 MiB all_gather at 63 % of a 1 Gbit/s link (docs/hosts.md).
#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/hierarchical_pipeline.h"
#include "collectives/p2p/exchange.h"
#include "common/error.h"

namespace torchpar::collectives::hier {
namespace {

void allgather_by_rails(Comm& c, const void* in, void* const* outs, size_t count, c10::ScalarType dtype,
                        const shm::OpDesc& desc) {
  const Hierarchy& h = *c.hierarchy;
  const HostMap& map = h.map;
  const size_t es = element_size(dtype), local = h.local_ranks().size();
  const int hosts = map.hosts(), me = h.host();
  size_t chunk = pipeline_chunk(c, dtype, count, static_cast<size_t>(c.size()));
  if (chunk == 0) chunk = std::max<size_t>(count, 1);
  const size_t chunks = p2p::chunks_of(count, chunk);
  auto at = [&](int r, const Piece& s) { return static_cast<char*>(outs[r]) + s.begin * es; };

  const std::vector<int> rail = rail_of(h);
  Comm host = host_comm(c);
  Comm peers = hosts_comm(c, rail);
  p2p::Exchange ex(peers);
  // Every chunk's receives, before any peer sends (when large: hosts_comm): host g's block on
  // this rail.
  std::vector<std::vector<p2p::Exchange::Handle>> arrived(chunks);
  for (size_t k = 0; k < chunks; ++k) {
    const Piece s = chunk_span(k, chunk, count);
    for (int g = 0; g < hosts; ++g) {
      if (g != me) arrived[k].push_back(ex.recv(g, p2p::Phase::kGather, static_cast<uint32_t>(k), at(rail[g], s), s.size() * es));
    }
  }
  if (rail_agrees(chunks, hosts, count * es)) p2p::agree(peers, desc, &ex);

  // Host g's blocks (chunk s) gathered on every rank of this host: member q gives the block of
  // host g's local rank q, its own or the one it received.
  std::vector<void*> host_outs(local);
  auto gather_host = [&](int g, const Piece& s) {
    for (size_t q = 0; q < local; ++q) host_outs[q] = at(map.ranks_of[g][q], s);
    const void* mine = g == me ? static_cast<const char*>(in) + s.begin * es : at(rail[g], s);
    collectives::allgather(host, mine, host_outs.data(), s.size(), dtype);
  };
  for (size_t k = 0; k < chunks + 1; ++k) {
    if (k < chunks) {  // chunk k of this rank's block to its peers, then to this host
      const Piece s = chunk_span(k, chunk, count);
      for (int g = 0; g < hosts; ++g) {
        if (g != me) ex.send(g, p2p::Phase::kGather, static_cast<uint32_t>(k), static_cast<const char*>(in) + s.begin * es, s.size() * es);
      }
      gather_host(me, s);
    }
    if (k >= 1) {  // chunk k-1 of the other hosts' blocks, as this host's ranks received them
      const Piece s = chunk_span(k - 1, chunk, count);
      for (auto& handle : arrived[k - 1]) ex.wait(handle);
      for (int g = 0; g < hosts; ++g) {
        if (g != me) gather_host(g, s);
      }
    }
  }
  ex.wait_all();
}

void allgather_through_leaders(Comm& c, const void* in, void* const* outs, size_t count, c10::ScalarType dtype,
                               const shm::OpDesc& desc) {
  const Hierarchy& h = *c.hierarchy;
  const HostMap& map = h.map;
  const std::vector<int>& mine = h.local_ranks();
  const size_t es = element_size(dtype);
  const int hosts = map.hosts(), me = h.host();
  const bool shared = h.arena != nullptr;
  // The stages in one go (chunk = count) up to two slots; else in chunks of every block.
  size_t chunk = pipeline_chunk(c, dtype, count, static_cast<size_t>(c.size()));
  if (chunk == 0) chunk = std::max<size_t>(count, 1);
  const size_t chunks = p2p::chunks_of(count, chunk);
  auto at = [&](int r, const Piece& s) { return static_cast<char*>(outs[r]) + s.begin * es; };

  Comm host = host_comm(c);
  Comm leaders = leaders_comm(c);
  p2p::Exchange ex(leaders);
  // Chunk k of block i of host g arrives as message k x (g's ranks) + i: a rank's output
  // blocks need not be adjacent, so each block's chunk is a message of its own.
  std::vector<std::vector<p2p::Exchange::Handle>> arrived(chunks);
  auto post_receives = [&] {  // every chunk's, before any leader sends (hosts_comm)
    for (size_t k = 0; k < chunks; ++k) {
      const Piece s = chunk_span(k, chunk, count);
      for (int g = 0; g < hosts; ++g) {
        const size_t n = map.ranks_of[g].size();
        for (size_t i = 0; g != me && i < n; ++i) {
          arrived[k].push_back(ex.recv(g, p2p::Phase::kGather, static_cast<uint32_t>(k * n + i),
                                       at(map.ranks_of[g][i], s), s.size() * es));
        }
      }
    }
    p2p::agree(leaders, desc, &ex);
  };
  if (!shared && count && outs[c.rank()] != in) std::memmove(outs[c.rank()], in, count * es);

  std::vector<void*> host_outs(mine.size());
  for (size_t k = 0; k < chunks + 1; ++k) {
    if (k < chunks) {  // chunk k of this host's blocks, on every rank of it, then to the others
      const Piece s = chunk_span(k, chunk, count);
      if (shared) {
        for (size_t i = 0; i < mine.size(); ++i) host_outs[i] = at(mine[i], s);
        collectives::allgather(host, static_cast<const char*>(in) + s.begin * es, host_outs.data(), s.size(), dtype);
      }
      if (h.leader() && k == 0) post_receives();
      for (int g = 0; h.leader() && g < hosts; ++g) {
        for (size_t i = 0; g != me && i < mine.size(); ++i) {
          ex.send(g, p2p::Phase::kGather, static_cast<uint32_t>(k * mine.size() + i), at(mine[i], s), s.size() * es);
        }
      }
    }
    if (k >= 1) {  // chunk k-1 of the other hosts' blocks, from the leader to the rest of its host
      const Piece s = chunk_span(k - 1, chunk, count);
      if (h.leader()) {
        for (auto& handle : arrived[k - 1]) ex.wait(handle);
      }
      if (shared) {
        Segments theirs;
        for (int r = 0; r < c.size(); ++r) {
          if (!map.same_host(r, c.rank())) theirs.add(at(r, s), s.size() * es);
        }
        collectives::broadcast(host, theirs, (c.size() - mine.size()) * s.size(), dtype, /*root=*/0);
      }
    }
  }
  ex.wait_all();
}

}  // namespace

void allgather(Comm& c, const void* in, void* const* outs, size_t count, c10::ScalarType dtype) {
  const auto desc = op_desc(OpKind::kAllgather, dtype, count);
  std::string message = agree(c, desc);
  if (!message.empty()) throw UsageError(message);
  if (even_hosts(c.hierarchy->map)) return allgather_by_rails(c, in, outs, count, dtype, desc);
  allgather_through_leaders(c, in, outs, count, dtype, desc);
}

}  // namespace torchpar::collectives::hier
