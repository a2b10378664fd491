// all_reduce across hosts (issue 21; hierarchical.h): reduce into each host's leader through
// the arena, all-reduce among the leaders, broadcast within each host; or, on hosts of equal
// size beyond two slots, by rails (by_rails, below: every rank does a 1/L share).
//
// Up to two arena slots' worth the three stages run one after the other. Beyond, they run as
// a pipeline, chunk by chunk (up to 8 chunks, each a slot or more): while the network carries chunk k, the
// host reduces chunk k+1 and broadcasts chunk k-2, so on a slow link the stages inside the
// hosts hide behind the transfer (one after the other, a 64 MiB all_reduce spent ~10 % of
// its time in them: issue 21's 90 %-of-the-link target). Among the leaders each chunk is a
// direct reduce-scatter then all-gather (as p2p/reduce.cpp): leader g reduces piece g of the
// chunk and sends it back to the others. Every element is added in the same order either way.
#include <algorithm>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/hierarchical_pipeline.h"
#include "collectives/p2p/exchange.h"
#include "common/error.h"

namespace torchpar::collectives::hier {
namespace {

void divide(const Comm& c, c10::ScalarType dtype, char* at, size_t count) {
  const void* src = at;
  if (count) collectives::reduce(dtype, ReduceOp::kAvg, at, &src, 1, count, c.size());
}

// Among hosts (the leaders, or a rail; member g is host g): once `arrived` (the other
// members' contributions to this member's part of chunk k) are in, adds every host's in host
// order into `at` (this member's own contribution; from(g): member g's), divides for AVG, and
// sends the result to the others as chunk k of the gather phase.
template <typename From>
void add_and_send_back(Comm& c, p2p::Exchange& ex, const std::vector<p2p::Exchange::Handle>& arrived, size_t k,
                       char* at, size_t count, c10::ScalarType dtype, ReduceOp op, From from) {
  const int hosts = c.hierarchy->map.hosts(), me = c.hierarchy->host();
  for (const auto& handle : arrived) ex.wait(handle);
  std::vector<const void*> srcs(hosts);
  for (int g = 0; g < hosts; ++g) srcs[g] = g == me ? at : from(g);
  const ReduceOp partial = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  collectives::reduce(dtype, partial, at, srcs.data(), hosts, count, hosts);
  if (op == ReduceOp::kAvg) divide(c, dtype, at, count);
  for (int g = 0; g < hosts; ++g) {
    if (g != me) ex.send(g, p2p::Phase::kGather, static_cast<uint32_t>(k), at, count * element_size(dtype));
  }
}

void in_stages(Comm& c, const Segments& data, size_t count, c10::ScalarType dtype, ReduceOp op, ReduceOp partial) {
  const Hierarchy& h = *c.hierarchy;
  const size_t es = element_size(dtype);
  Comm host = host_comm(c);
  if (h.arena != nullptr) {
    host.begin(op_desc(OpKind::kReduce, dtype, count, 0, static_cast<int>(partial)));
    reduce_in_chunks(host, data, count, dtype, partial, /*root=*/0);
  }
  if (h.leader()) {
    Comm leaders = leaders_comm(c);
    p2p::allreduce(leaders, data, count, dtype, partial);
    if (op == ReduceOp::kAvg) data.for_each(0, count * es, [&](char* at, size_t, size_t n) { divide(c, dtype, at, n / es); });
  }
  if (h.arena != nullptr) collectives::broadcast(host, data, count, dtype, 0);
}

void pipelined(Comm& c, const Segments& data, size_t count, size_t chunk, c10::ScalarType dtype, ReduceOp op,
               ReduceOp partial) {
  const Hierarchy& h = *c.hierarchy;
  const size_t es = element_size(dtype), bytes = count * es;
  const size_t chunks = p2p::chunks_of(count, chunk);
  const int hosts = h.map.hosts(), me = h.host();
  auto span = [&](size_t k) { return chunk_span(k, chunk, count); };
  Comm host = host_comm(c);
  Comm leaders = leaders_comm(c);

  // The leader's buffer: the data itself, or (several tensors) a packed copy in staging, since
  // sockets take bytes from one place. Then the other leaders' contributions to its pieces:
  // [chunk][leader other than itself], each piece_of(chunk, hosts, me) long.
  const size_t piece_cap = piece_of(chunk, hosts, 0).size();
  char* flat = data.contiguous();
  char* incoming = nullptr;
  if (h.leader()) {
    const size_t packed = flat ? 0 : (bytes + 63) / 64 * 64;
    char* staged = c.staging(packed + chunks * (hosts - 1) * piece_cap * es);
    if (!flat) {
      flat = staged;
      data.gather(flat, 0, bytes, false);
    }
    incoming = staged + packed;
  }
  const Segments& mine = h.leader() ? Segments(flat, bytes) : data;
  auto from = [&](size_t k, int g) { return incoming + (k * (hosts - 1) + (g - (g > me))) * piece_cap * es; };
  auto piece = [&](size_t k, int g) {
    const Piece s = span(k), p = piece_of(s.size(), hosts, g);
    return Piece{s.begin + p.begin, s.begin + p.end};
  };

  std::vector<std::vector<p2p::Exchange::Handle>> contributions(chunks), reduced(chunks);
  p2p::Exchange ex(leaders);
  if (h.leader()) {
    // Every receive is posted before any leader sends (the leaders' agreement): data lands in
    // place, never in the engine's buffer for early arrivals. Leader g's reduced piece g of a
    // chunk lands where our copy of it was; g reduces it only once our copy has reached it.
    for (size_t k = 0; k < chunks; ++k) {
      for (int g = 0; g < hosts; ++g) {
        if (g == me) continue;
        const Piece own = piece(k, me), theirs = piece(k, g);
        contributions[k].push_back(ex.recv(g, p2p::Phase::kScatter, static_cast<uint32_t>(k), from(k, g), own.size() * es));
        reduced[k].push_back(ex.recv(g, p2p::Phase::kGather, static_cast<uint32_t>(k), flat + theirs.begin * es, theirs.size() * es));
      }
    }
    p2p::agree(leaders, op_desc(OpKind::kAllreduce, dtype, count, 0, static_cast<int>(op)), &ex);
  }
  for (size_t k = 0; k < chunks + 2; ++k) {
    if (k < chunks) {
      const Piece s = span(k);
      if (h.arena != nullptr) {
        host.begin(op_desc(OpKind::kReduce, dtype, s.size(), 0, static_cast<int>(partial)));
        reduce_in_chunks(host, slice(mine, s.begin * es, s.size() * es), s.size(), dtype, partial, /*root=*/0);
      }
      for (int g = 0; h.leader() && g < hosts; ++g) {
        const Piece p = piece(k, g);
        if (g != me) ex.send(g, p2p::Phase::kScatter, static_cast<uint32_t>(k), flat + p.begin * es, p.size() * es);
      }
    }
    if (h.leader() && k >= 1 && k <= chunks) {  // piece `me` of chunk k-1: every host's, in host order
      const Piece p = piece(k - 1, me);
      add_and_send_back(c, ex, contributions[k - 1], k - 1, flat + p.begin * es, p.size(), dtype, op,
                        [&](int g) { return from(k - 1, g); });
    }
    if (k >= 2) {
      const Piece s = span(k - 2);
      if (h.leader()) {
        for (auto& handle : reduced[k - 2]) ex.wait(handle);
      }
      if (h.arena != nullptr) {
        collectives::broadcast(host, slice(mine, s.begin * es, s.size() * es), s.size(), dtype, /*root=*/0);
      }
    }
  }
  ex.wait_all();
  if (h.leader() && flat != data.contiguous()) data.scatter(0, flat, bytes);
}

// On hosts of equal size L, beyond two slots: by rails. Chunk k of the buffer (a multiple of
// L elements) is cut into L pieces; a reduce-scatter inside the host leaves local rank l with
// the host's partial of piece l; the ranks of rail l (local rank l of every host) all-reduce
// piece l among themselves as the leaders do a whole chunk (rail member g reduces part g of
// it, in host order, and sends it back); an all-gather inside the host spreads the pieces.
// Every rank does 1/L of the host's work and traffic, as a pipeline: while the rails carry
// chunk k, the host reduces chunk k + 1 and gathers chunk k - 2. The last count % L elements
// (fewer than L) go through in_stages. Same order of summation: the leaders' bits.
void by_rails(Comm& c, const Segments& data, size_t count, size_t chunk, c10::ScalarType dtype, ReduceOp op,
              ReduceOp partial) {
  const Hierarchy& h = *c.hierarchy;
  const size_t es = element_size(dtype), local = h.local_ranks().size();
  const int hosts = h.map.hosts(), me = h.host(), lane = h.local_rank();
  const size_t tail = count % local, body = count - tail;
  chunk = (chunk + 16 * local - 1) / (16 * local) * (16 * local);  // pieces of whole vectors
  const size_t chunks = p2p::chunks_of(body, chunk);
  auto span = [&](size_t k) { return chunk_span(k, chunk, body); };
  // Piece q of chunk k (local rank q's), and part g of this rank's piece (rail member g's).
  auto piece = [&](size_t k, size_t q) {
    const Piece s = span(k);
    const size_t n = s.size() / local;
    return Piece{s.begin + q * n, s.begin + (q + 1) * n};
  };
  auto part = [&](size_t k, int g) {
    const Piece p = piece(k, lane), t = piece_of(p.size(), hosts, g);
    return Piece{p.begin + t.begin, p.begin + t.end};
  };

  // The buffer (packed into staging when it is several tensors: sockets and the arena's
  // reduce-scatter take one place), then the rail's contributions to this rank's parts:
  // [chunk][member other than itself], each part_cap long.
  const size_t bytes = body * es, part_cap = piece_of(chunk / local, hosts, 0).size();
  char* flat = data.contiguous();
  const size_t packed = flat ? 0 : (bytes + 63) / 64 * 64;
  char* staged = c.staging(packed + chunks * (hosts - 1) * part_cap * es);
  if (!flat) {
    flat = staged;
    data.gather(flat, 0, bytes, false);
  }
  char* incoming = staged + packed;
  auto from = [&](size_t k, int g) { return incoming + (k * (hosts - 1) + (g - (g > me))) * part_cap * es; };

  const std::vector<int> rail = rail_of(h);
  Comm host = host_comm(c);
  Comm peers = hosts_comm(c, rail);
  p2p::Exchange ex(peers);
  std::vector<std::vector<p2p::Exchange::Handle>> contributions(chunks), reduced(chunks);
  for (size_t k = 0; k < chunks; ++k) {  // every receive before any peer sends (hosts_comm)
    for (int g = 0; g < hosts; ++g) {
      if (g == me) continue;
      const Piece own = part(k, me), theirs = part(k, g);
      contributions[k].push_back(ex.recv(g, p2p::Phase::kScatter, static_cast<uint32_t>(k), from(k, g), own.size() * es));
      reduced[k].push_back(ex.recv(g, p2p::Phase::kGather, static_cast<uint32_t>(k), flat + theirs.begin * es, theirs.size() * es));
    }
  }
  p2p::agree(peers, op_desc(OpKind::kAllreduce, dtype, count, 0, static_cast<int>(op)), &ex);

  std::vector<const void*> ins(local);
  std::vector<void*> outs(local);
  for (size_t k = 0; k < chunks + 2; ++k) {
    if (k < chunks) {  // chunk k reduced within the host, piece by piece; this rank's parts out
      for (size_t q = 0; q < local; ++q) ins[q] = flat + piece(k, q).begin * es;
      const Piece mine = piece(k, lane);
      collectives::reduce_scatter(host, ins.data(), flat + mine.begin * es, mine.size(), dtype, partial);
      for (int g = 0; g < hosts; ++g) {
        const Piece p = part(k, g);
        if (g != me) ex.send(g, p2p::Phase::kScatter, static_cast<uint32_t>(k), flat + p.begin * es, p.size() * es);
      }
    }
    if (k >= 1 && k <= chunks) {  // part `me` of chunk k-1: every host's, in host order
      const Piece p = part(k - 1, me);
      add_and_send_back(c, ex, contributions[k - 1], k - 1, flat + p.begin * es, p.size(), dtype, op,
                        [&](int g) { return from(k - 1, g); });
    }
    if (k >= 2) {  // chunk k-2: this rank's piece is whole; the host gathers the pieces
      for (auto& handle : reduced[k - 2]) ex.wait(handle);
      for (size_t q = 0; q < local; ++q) outs[q] = flat + piece(k - 2, q).begin * es;
      const Piece mine = piece(k - 2, lane);
      collectives::allgather(host, flat + mine.begin * es, outs.data(), mine.size(), dtype);
    }
  }
  ex.wait_all();
  if (flat != data.contiguous()) data.scatter(0, flat, bytes);
  if (tail) in_stages(c, slice(data, bytes, tail * es), tail, dtype, op, partial);
}

}  // namespace

void allreduce(Comm& c, const Segments& data, size_t count, c10::ScalarType dtype, ReduceOp op) {
  const auto desc = op_desc(OpKind::kAllreduce, dtype, count, 0, static_cast<int>(op));
  std::string message = agree(c, desc);
  if (!message.empty()) throw UsageError(message);
  // AVG: sums all the way, then one division by the group's size (on the leaders).
  const ReduceOp partial = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  // Pipelined beyond two slots (hierarchical_pipeline.h).
  const size_t chunk = pipeline_chunk(c, dtype, count);
  if (chunk == 0) {
    in_stages(c, data, count, dtype, op, partial);
  } else if (even_hosts(c.hierarchy->map)) {
    by_rails(c, data, count, chunk, dtype, op, partial);
  } else {
    pipelined(c, data, count, chunk, dtype, op, partial);
  }
}

}  // namespace torchpar::collectives::hier
