#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/stream_copy.h"
#include "common/error.h"

namespace torchpar::collectives {
namespace {

// Each rank's slot starts with this header: its send and receive counts (so that splits
// that do not pair up are an error on every rank) and whether its data follows.
struct SlotHeader {
  uint64_t staged;  // 1: this rank's whole input follows the counts in its slot
  uint64_t counts[1];  // [0, w): send counts; [w, 2w): receive counts
};

size_t header_bytes(int w) { return (1 + 2 * static_cast<size_t>(w)) * sizeof(uint64_t); }

struct Splits {
  std::vector<std::vector<uint64_t>> send;  // [q][r]: rank q sends this many to rank r
  bool all_staged = true;
};

// Publishes counts (and the data itself when it fits) in one step, then reads every rank's.
Splits exchange(Comm& c, const void* const* sends, const size_t* send_counts, const size_t* recv_counts,
                size_t es) {
  const int w = c.size();
  auto* mine = reinterpret_cast<SlotHeader*>(c.arena().slot(c.rank()));
  size_t total = 0;
  for (int r = 0; r < w; ++r) {
    mine->counts[r] = send_counts[r];
    mine->counts[w + r] = recv_counts[r];
    total += send_counts[r] * es;
  }
  mine->staged = header_bytes(w) + total <= c.arena().slot_bytes();
  if (mine->staged) {
    char* at = c.arena().slot(c.rank()) + header_bytes(w);
    for (int r = 0; r < w; ++r) {
      stream_copy(at, sends[r], send_counts[r] * es);
      at += send_counts[r] * es;
    }
  }
  c.arrive_and_wait();
  c.check_descriptors();
  Splits s{std::vector<std::vector<uint64_t>>(w)};
  std::string disagreement;
  for (int q = 0; q < w && disagreement.empty(); ++q) {
    auto* theirs = reinterpret_cast<const SlotHeader*>(c.arena().slot(q));
    s.send[q].assign(theirs->counts, theirs->counts + w);
    s.all_staged = s.all_staged && theirs->staged;
    for (int r = 0; r < w; ++r) {
      uint64_t expects = reinterpret_cast<const SlotHeader*>(c.arena().slot(r))->counts[w + q];
      if (theirs->counts[r] != expects) {
        disagreement = detail::message(__FILE__, __LINE__, "all_to_all split sizes disagree: rank ", q,
                                       " sends ", theirs->counts[r], " elements to rank ", r,
                                       ", which expects ", expects, " from it (collective #", c.seq, ")");
        break;
      }
    }
  }
  if (!disagreement.empty()) {
    c.arrive();  // done reading peers' slots
    throw UsageError(disagreement);
  }
  return s;
}

}  // namespace

// Small exchanges take one step through the arena: every rank stages its counts and all
// it sends, then copies its pieces out of every slot. Larger ones go in rounds: rank q's
// slot holds, at segment r, the next piece of what q sends to r, and every rank copies its
// segment out of every slot; as many rounds as the largest pair needs.
void alltoall(Comm& c, const void* const* sends, const size_t* send_counts, void* const* recvs,
              const size_t* recv_counts, c10::ScalarType dtype) {
  if (!c.shared) return p2p::alltoall(c, sends, send_counts, recvs, recv_counts, dtype);
  c.begin(op_desc(OpKind::kAlltoall, dtype, 0));
  const int w = c.size();
  const int me = c.rank();
  const size_t es = element_size(dtype);
  Splits s = exchange(c, sends, send_counts, recv_counts, es);

  if (s.all_staged) {
    for (int q = 0; q < w; ++q) {
      uint64_t before = 0;
      for (int r = 0; r < me; ++r) before += s.send[q][r];
      std::memcpy(recvs[q], c.arena().slot(q) + header_bytes(w) + before * es, recv_counts[q] * es);
    }
    c.arrive();
    return;
  }
  c.arrive();  // done with the counts
  std::memmove(recvs[me], sends[me], send_counts[me] * es);
  const size_t seg = std::max<size_t>(1, c.arena().slot_bytes() / w / es);
  uint64_t largest = 0;
  for (int q = 0; q < w; ++q) {
    for (int r = 0; r < w; ++r) {
      if (q != r) largest = std::max(largest, s.send[q][r]);
    }
  }
  auto piece = [&](size_t total, size_t round) {
    return std::min(seg, total - std::min(total, round * seg));
  };
  for (size_t k = 0; k * seg < largest; ++k) {
    c.wait_slot_free();
    for (int r = 0; r < w; ++r) {
      if (r != me) {
        stream_copy(c.arena().slot(me) + r * seg * es, static_cast<const char*>(sends[r]) + k * seg * es,
                    piece(send_counts[r], k) * es);
      }
    }
    c.arrive_and_wait();
    for (int q = 0; q < w; ++q) {
      if (q != me) {
        std::memcpy(static_cast<char*>(recvs[q]) + k * seg * es, c.arena().slot(q) + me * seg * es,
                    piece(recv_counts[q], k) * es);
      }
    }
    c.arrive();
  }
}

}  // namespace torchpar::collectives
