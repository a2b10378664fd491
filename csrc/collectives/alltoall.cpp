#include <algorithm>
#include <cstring>
#include <memory>
#include <sstream>
#include <vector>

#include "collectives/collectives.h"
#include "common/error.h"

namespace torchpar::collectives {
namespace {

// Every rank's send and receive counts, exchanged through the arena before any data
// moves, so that split sizes that disagree are an error on every rank.
struct Splits {
  std::vector<std::vector<uint64_t>> send;  // [q][r]: rank q sends this many to rank r
  std::vector<std::vector<uint64_t>> recv;  // [r][q]: rank r expects this many from rank q
};

Splits exchange_splits(Comm& c, const size_t* send_counts, const size_t* recv_counts) {
  const int w = c.size();
  auto* mine = reinterpret_cast<uint64_t*>(c.arena.slot(c.rank()));
  for (int r = 0; r < w; ++r) {
    mine[r] = send_counts[r];
    mine[w + r] = recv_counts[r];
  }
  c.arrive_and_wait();
  c.check_descriptors();
  Splits s{std::vector<std::vector<uint64_t>>(w), std::vector<std::vector<uint64_t>>(w)};
  for (int q = 0; q < w; ++q) {
    auto* theirs = reinterpret_cast<const uint64_t*>(c.arena.slot(q));
    s.send[q].assign(theirs, theirs + w);
    s.recv[q].assign(theirs + w, theirs + 2 * w);
  }
  c.arrive();  // done reading peers' counts
  for (int q = 0; q < w; ++q) {
    for (int r = 0; r < w; ++r) {
      TP_CHECK_USAGE(s.send[q][r] == s.recv[r][q], "all_to_all split sizes disagree: rank ", q, " sends ",
               s.send[q][r], " elements to rank ", r, ", which expects ", s.recv[r][q],
               " from it (collective #", c.seq, ")");
    }
  }
  return s;
}

void wait_all(Comm& c, const std::vector<std::shared_ptr<Request>>& reqs) {
  for (auto& req : reqs) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(c.deadline - Clock::now());
    if (!req->wait_for(std::max(left, std::chrono::milliseconds(0)))) {
      TP_THROW_TIMEOUT("all_to_all timed out waiting for rank ", req->peer);
    }
    if (req->error()) std::rethrow_exception(req->error());
  }
}

}  // namespace

// Small exchanges go through the arena (each rank stages all it sends; each receiver copies
// its pieces out); large ones go point to point, every pair at once, through the rings.
void alltoall(Comm& c, const void* const* sends, const size_t* send_counts, void* const* recvs,
              const size_t* recv_counts, c10::ScalarType dtype) {
  shm::OpDesc desc;
  desc.op = static_cast<uint32_t>(OpKind::kAlltoall);
  desc.dtype = static_cast<int32_t>(dtype);
  c.begin(desc);
  const int w = c.size();
  const int me = c.rank();
  const size_t es = element_size(dtype);
  Splits s = exchange_splits(c, send_counts, recv_counts);

  std::memmove(recvs[me], sends[me], send_counts[me] * es);
  uint64_t largest = 0;
  for (int q = 0; q < w; ++q) {
    uint64_t total = 0;
    for (int r = 0; r < w; ++r) total += s.send[q][r];
    largest = std::max(largest, total);
  }
  if (largest * es <= c.arena.slot_bytes()) {
    c.wait_slot_free();
    char* at = c.arena.slot(me);
    for (int r = 0; r < w; ++r) {
      std::memcpy(at, sends[r], send_counts[r] * es);
      at += send_counts[r] * es;
    }
    c.arrive_and_wait();
    for (int q = 0; q < w; ++q) {
      if (q == me) continue;
      uint64_t before = 0;
      for (int r = 0; r < me; ++r) before += s.send[q][r];
      std::memcpy(recvs[q], c.arena.slot(q) + before * es, recv_counts[q] * es);
    }
    c.arrive();
    return;
  }
  std::vector<std::shared_ptr<Request>> reqs;
  for (int q = 0; q < w; ++q) {
    if (q != me) reqs.push_back(c.p2p.irecv(q, c.p2p_tag(), recvs[q], recv_counts[q] * es, c.deadline));
  }
  for (int k = 1; k < w; ++k) {
    int r = (me + k) % w;  // staggered so that no rank is everyone's first target
    reqs.push_back(c.p2p.isend(r, c.p2p_tag(), sends[r], send_counts[r] * es, c.deadline));
  }
  wait_all(c, reqs);
}

}  // namespace torchpar::collectives
