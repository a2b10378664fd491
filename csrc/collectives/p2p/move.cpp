// The collectives that move data without reducing it, over point-to-point messages:
// broadcast down a binomial tree (chunked, so a rank forwards chunk k while chunk k+1
// arrives); all_gather, gather, scatter and all_to_all straight between each pair. Each
// posts its receives before agree(), so data lands in place, never in the engine's buffer
// for early arrivals (allocated, filled, then copied again).
#include <cstring>
#include <string>
#include <vector>

#include "collectives/p2p/exchange.h"
#include "collectives/p2p/p2p.h"
#include "common/error.h"

namespace torchpar::collectives::p2p {
namespace {

// Whether any receive buffer shares memory with any send buffer.
bool overlaps(const void* const* sends, const size_t* send_counts, void* const* recvs,
              const size_t* recv_counts, int w, size_t es) {
  for (int q = 0; q < w; ++q) {
    auto* r = static_cast<const char*>(recvs[q]);
    for (int s = 0; s < w; ++s) {
      auto* d = static_cast<const char*>(sends[s]);
      if (recv_counts[q] && send_counts[s] && r < d + send_counts[s] * es && d < r + recv_counts[q] * es) {
        return true;
      }
    }
  }
  return false;
}

}  // namespace

void broadcast(Comm& c, void* data, size_t count, c10::ScalarType dtype, int root) {
  const int w = c.size();
  const int rel = (c.rank() - root + w) % w;  // rank counted from the root
  // Relative rank rel receives from rel minus its lowest set bit, and sends to rel + m for
  // each power of two m below that bit (largest subtree first).
  int parent = -1, bit = 1;
  for (; bit < w; bit <<= 1) {
    if (rel & bit) {
      parent = (rel - bit + root) % w;
      break;
    }
  }
  std::vector<int> children;
  for (int m = bit >> 1; m > 0; m >>= 1) {
    if (rel + m < w) children.push_back((rel + m + root) % w);
  }
  char* bytes = static_cast<char*>(data);
  const size_t total = count * element_size(dtype), chunk = chunk_elements(c, dtype, count) * element_size(dtype);
  Exchange ex(c);
  std::vector<Exchange::Handle> arrivals;
  for (size_t k = 0; parent >= 0 && k < chunks_of(total, chunk); ++k) {
    arrivals.push_back(ex.recv(parent, Phase::kTree, k, bytes + k * chunk, std::min(chunk, total - k * chunk)));
  }
  agree(c, op_desc(OpKind::kBroadcast, dtype, count, root), &ex);
  // A leaf only receives: it waits once, not once per chunk (each wake-up costs a thread
  // hand-off).
  for (size_t k = 0; !children.empty() && k < chunks_of(total, chunk); ++k) {
    if (parent >= 0) ex.wait(arrivals[k]);
    for (int child : children) ex.send(child, Phase::kTree, k, bytes + k * chunk, std::min(chunk, total - k * chunk));
  }
  ex.wait_all();
}

void allgather(Comm& c, const void* in, void* const* outs, size_t count, c10::ScalarType dtype) {
  const size_t bytes = count * element_size(dtype);
  Exchange ex(c);
  for (int q = 0; q < c.size(); ++q) {
    if (q != c.rank()) ex.recv(q, Phase::kDirect, 0, outs[q], bytes);
  }
  agree(c, op_desc(OpKind::kAllgather, dtype, count), &ex);
  for (int q = 0; q < c.size(); ++q) {
    if (q != c.rank()) ex.send(q, Phase::kDirect, 0, in, bytes);
  }
  if (bytes && outs[c.rank()] != in) std::memmove(outs[c.rank()], in, bytes);
  ex.wait_all();
}

void gather(Comm& c, const void* in, void* const* outs, size_t count, c10::ScalarType dtype, int root) {
  const size_t bytes = count * element_size(dtype);
  Exchange ex(c);
  for (int q = 0; c.rank() == root && q < c.size(); ++q) {
    if (q != root) ex.recv(q, Phase::kDirect, 0, outs[q], bytes);
  }
  agree(c, op_desc(OpKind::kGather, dtype, count, root), &ex);
  if (c.rank() != root) {
    ex.send(root, Phase::kDirect, 0, in, bytes);
  } else if (bytes && outs[root] != in) {
    std::memmove(outs[root], in, bytes);
  }
  ex.wait_all();
}

void scatter(Comm& c, const void* const* ins, void* out, size_t count, c10::ScalarType dtype, int root) {
  const size_t bytes = count * element_size(dtype);
  Exchange ex(c);
  if (c.rank() != root) ex.recv(root, Phase::kDirect, 0, out, bytes);
  agree(c, op_desc(OpKind::kScatter, dtype, count, root), &ex);
  if (c.rank() == root) {
    for (int q = 0; q < c.size(); ++q) {
      if (q != root) ex.send(q, Phase::kDirect, 0, ins[q], bytes);
    }
    if (bytes && out != ins[root]) std::memmove(out, ins[root], bytes);
  }
  ex.wait_all();
}

void alltoall(Comm& c, const void* const* sends, const size_t* send_counts, void* const* recvs,
              const size_t* recv_counts, c10::ScalarType dtype) {
  const int w = c.size(), me = c.rank();
  const size_t es = element_size(dtype);
  // In place (outputs over inputs), a peer's data could land on ours before ours has gone
  // out: send from a copy then, made before any receive is posted.
  std::vector<const void*> from(sends, sends + w);
  if (overlaps(sends, send_counts, recvs, recv_counts, w, es)) {
    size_t total = 0;
    for (int r = 0; r < w; ++r) total += send_counts[r] * es;
    char* copy = c.staging(total);  // (the group's staging memory is never a user buffer)
    for (int r = 0; r < w; ++r) {
      std::memcpy(copy, sends[r], send_counts[r] * es);
      from[r] = copy;
      copy += send_counts[r] * es;
    }
  }
  Exchange ex(c);
  for (int q = 0; q < w; ++q) {
    if (q != me) ex.recv(q, Phase::kDirect, 0, recvs[q], recv_counts[q] * es);
  }
  agree(c, op_desc(OpKind::kAlltoall, dtype, 0), &ex);
  // Every rank's counts go to every rank before any data, so splits that do not pair up are
  // the same error everywhere rather than a failed receive on one rank.
  std::vector<uint64_t> counts(2 * static_cast<size_t>(w) * w);  // rank q's at [2wq, 2w(q+1))
  for (int r = 0; r < w; ++r) {
    counts[2 * w * me + r] = send_counts[r];
    counts[2 * w * me + w + r] = recv_counts[r];
  }
  share(c, Phase::kCounts, counts.data(), 2 * static_cast<size_t>(w) * sizeof(uint64_t));
  for (int q = 0; q < w; ++q) {
    for (int r = 0; r < w; ++r) {
      const uint64_t sends_to = counts[2 * w * q + r], expects = counts[2 * w * r + w + q];
      if (sends_to == expects) continue;
      ex.cancel_all();  // no rank sends its data now
      throw UsageError(detail::message(__FILE__, __LINE__, "all_to_all split sizes disagree: rank ", q, " sends ",
                                       sends_to, " elements to rank ", r, ", which expects ", expects,
                                       " from it (collective #", c.seq, ")"));
    }
  }
  for (int q = 0; q < w; ++q) {
    if (q != me) ex.send(q, Phase::kDirect, 0, from[q], send_counts[q] * es);
  }
  if (send_counts[me] && recvs[me] != from[me]) std::memmove(recvs[me], from[me], send_counts[me] * es);
  ex.wait_all();
}

void barrier(Comm& c) { agree(c, op_desc(OpKind::kBarrier, c10::ScalarType::Byte, 0)); }

}  // namespace torchpar::collectives::p2p
