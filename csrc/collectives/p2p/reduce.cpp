// all_reduce, reduce and reduce_scatter over point-to-point messages: a direct
// reduce-scatter (rank q sends rank r its contribution to r's piece), then, for the
// all-reduce and reduce, the reduced pieces go to the ranks that receive the result.
// Chunk by chunk, so reducing one chunk overlaps the arrival of the next. Receives are
// posted before agree(), so data lands in place, never in the engine's buffer for early
// arrivals.
#include <algorithm>
#include <vector>

#include "collectives/p2p/exchange.h"
#include "collectives/p2p/p2p.h"
#include "common/error.h"

namespace torchpar::collectives::p2p {
namespace {

// Receives every peer's contribution to this rank's `n` elements into `incoming` (W−1
// times n elements), agrees on `desc`, and sends every peer q its `send_counts[q]` elements
// at `sends[q]`; as each chunk k is in from every peer, reduces the W contributions (this
// rank's from `own`) into `dst` and calls done(k, begin, len).
template <typename Done>
void reduce_incoming(Comm& c, const shm::OpDesc& desc, Exchange& ex, const std::vector<const char*>& sends,
                     const std::vector<size_t>& send_counts, const char* own, char* incoming, char* dst,
                     size_t n, size_t chunk, c10::ScalarType dtype, ReduceOp op, Done&& done) {
  const int w = c.size(), me = c.rank();
  const size_t es = element_size(dtype);
  auto from = [&](int q) { return incoming + static_cast<size_t>(q - (q > me)) * n * es; };

  std::vector<std::vector<Exchange::Handle>> arrivals(chunks_of(n, chunk));
  for (size_t k = 0; k < arrivals.size(); ++k) {
    const size_t len = std::min(chunk, n - k * chunk);
    for (int q = 0; q < w; ++q) {
      if (q != me) arrivals[k].push_back(ex.recv(q, Phase::kScatter, k, from(q) + k * chunk * es, len * es));
    }
  }
  agree(c, desc, &ex);
  size_t rounds = 0;
  for (int q = 0; q < w; ++q) rounds = std::max(rounds, chunks_of(send_counts[q], chunk));
  for (size_t k = 0; k < rounds; ++k) {
    for (int i = 1; i < w; ++i) {
      const int q = (me + i) % w;  // staggered, so that not every rank feeds rank 0 first
      if (k * chunk < send_counts[q]) {
        ex.send(q, Phase::kScatter, k, sends[q] + k * chunk * es,
                std::min(chunk, send_counts[q] - k * chunk) * es);
      }
    }
  }
  std::vector<const void*> srcs(w);
  for (size_t k = 0; k < arrivals.size(); ++k) {
    for (auto& h : arrivals[k]) ex.wait(h);
    const size_t begin = k * chunk, len = std::min(chunk, n - begin);
    for (int q = 0; q < w; ++q) srcs[q] = (q == me ? own : from(q)) + begin * es;
    collectives::reduce(dtype, op, dst + begin * es, srcs.data(), w, len, w);
    done(k, begin, len);
  }
}

// Bytes of staging memory reduce_to needs: peers' contributions, and on a rank that does
// not receive the result (whose data must stay unchanged) the reduced piece.
size_t staging_for(const Comm& c, size_t count, size_t es, int root) {
  const size_t w = c.size();
  const bool receives = root < 0 || root == c.rank();
  if (count * es <= static_cast<size_t>(c.config.oneshot_max_bytes)) return receives ? (w - 1) * count * es : 0;
  return (w - 1 + (receives ? 0 : 1)) * piece_of(count, c.size(), c.rank()).size() * es;
}

// In place on the receivers: every rank (root < 0) or the root; the others' data is left
// unchanged. Its staging starts `at` bytes into the group's (what lies before is the
// caller's).
void reduce_to(Comm& c, const shm::OpDesc& desc, char* data, size_t count, c10::ScalarType dtype, ReduceOp op,
               int root, size_t at = 0) {
  const int w = c.size(), me = c.rank();
  const size_t es = element_size(dtype), bytes = count * es;
  const bool receives = root < 0 || root == me;
  char* staged = c.staging(at + staging_for(c, count, es, root)) + at;
  auto wants = [&](int q) { return q != me && (root < 0 || q == root); };
  Exchange ex(c);

  // Small: one step. Every rank sends its whole buffer to every receiver.
  if (bytes <= static_cast<size_t>(c.config.oneshot_max_bytes)) {
    char* incoming = staged;
    auto from = [&](int q) { return incoming + static_cast<size_t>(q - (q > me)) * bytes; };
    if (receives) {
      for (int q = 0; q < w; ++q) {
        if (q != me) ex.recv(q, Phase::kDirect, 0, from(q), bytes);
      }
    }
    agree(c, desc, &ex);
    for (int q = 0; q < w; ++q) {
      if (wants(q)) ex.send(q, Phase::kDirect, 0, data, bytes);
    }
    ex.wait_all();
    if (!receives || count == 0) return;
    std::vector<const void*> srcs(w);
    for (int q = 0; q < w; ++q) srcs[q] = q == me ? data : from(q);
    collectives::reduce(dtype, op, data, srcs.data(), w, count, w);
    return;
  }

  const size_t chunk = chunk_elements(c, dtype, count);
  const Piece mine = piece_of(count, w, me);
  std::vector<const char*> sends(w);
  std::vector<size_t> send_counts(w, 0);
  for (int q = 0; q < w; ++q) {
    const Piece p = piece_of(count, w, q);
    sends[q] = data + p.begin * es;
    if (q != me) send_counts[q] = p.size();
  }
  char* incoming = staged;
  char* dst = receives ? data + mine.begin * es : incoming + (w - 1) * mine.size() * es;
  // The reduced pieces' receives are posted now. Rank q's reduced chunk k lands where our
  // chunk k of piece q was; q can only reduce it once our copy of it has reached q, so by
  // then we have finished sending it.
  if (receives) {
    for (int q = 0; q < w; ++q) {
      if (q == me) continue;
      const Piece p = piece_of(count, w, q);
      for (size_t k = 0; k < chunks_of(p.size(), chunk); ++k) {
        const size_t len = std::min(chunk, p.size() - k * chunk);
        ex.recv(q, Phase::kGather, k, data + (p.begin + k * chunk) * es, len * es);
      }
    }
  }
  reduce_incoming(c, desc, ex, sends, send_counts, data + mine.begin * es, incoming, dst, mine.size(), chunk, dtype, op,
                  [&](size_t k, size_t begin, size_t len) {
                    for (int q = 0; q < w; ++q) {
                      if (wants(q)) ex.send(q, Phase::kGather, k, dst + begin * es, len * es);
                    }
                  });
  ex.wait_all();
}

}  // namespace

void allreduce(Comm& c, const Segments& data, size_t count, c10::ScalarType dtype, ReduceOp op) {
  const auto desc = op_desc(OpKind::kAllreduce, dtype, count, 0, static_cast<int>(op));
  if (char* flat = data.contiguous()) {
    reduce_to(c, desc, flat, count, dtype, op, /*root=*/-1);
    return;
  }
  // Several tensors (a coalesced all-reduce): packed into one buffer, since sockets take
  // bytes from one place; in the group's staging memory, ahead of what reduce_to stages
  // (sized for both at once, so that reduce_to's call cannot move it).
  const size_t at = (data.bytes() + 63) / 64 * 64;
  char* packed = c.staging(at + staging_for(c, count, element_size(dtype), -1));
  data.gather(packed, 0, data.bytes(), false);
  reduce_to(c, desc, packed, count, dtype, op, -1, at);
  data.scatter(0, packed, data.bytes());
}

void reduce(Comm& c, void* data, size_t count, c10::ScalarType dtype, ReduceOp op, int root) {
  reduce_to(c, op_desc(OpKind::kReduce, dtype, count, root, static_cast<int>(op)), static_cast<char*>(data), count,
            dtype, op, root);
}

void reduce_scatter(Comm& c, const void* const* ins, void* out, size_t count, c10::ScalarType dtype,
                    ReduceOp op) {
  const int w = c.size(), me = c.rank();
  std::vector<const char*> sends(w);
  std::vector<size_t> send_counts(w, count);
  for (int q = 0; q < w; ++q) sends[q] = static_cast<const char*>(ins[q]);
  send_counts[me] = 0;
  Exchange ex(c);
  char* incoming = c.staging(static_cast<size_t>(w - 1) * count * element_size(dtype));
  reduce_incoming(c, op_desc(OpKind::kReduceScatter, dtype, count, 0, static_cast<int>(op)), ex, sends, send_counts,
                  sends[me], incoming, static_cast<char*>(out), count,
                  chunk_elements(c, dtype, count), dtype, op,
                  [](size_t, size_t, size_t) {});
  ex.wait_all();
}

}  // namespace torchpar::collectives::p2p
