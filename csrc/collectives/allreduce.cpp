#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/collectives.h"

namespace torchpar::collectives {
namespace {

// Below ~64 KiB the cost is synchronisation, not bandwidth: one barrier, then each rank
// reads all W slots and computes the whole result itself. Its own operand comes straight
// from its input (bit-identical to its slot, so every rank still sums the same values in
// the same order).
void allreduce_oneshot(Comm& c, char* data, size_t count, c10::ScalarType dtype, ReduceOp op) {
  size_t bytes = count * element_size(dtype);
  std::memcpy(c.arena.slot(c.rank()), data, bytes);
  c.arrive_and_wait();
  c.check_descriptors();
  std::vector<const void*> srcs(c.size());
  for (int r = 0; r < c.size(); ++r) srcs[r] = r == c.rank() ? data : c.arena.slot(r);
  reduce(dtype, op, data, srcs.data(), c.size(), count, c.size());
  c.arrive();
}

// Large messages move each byte across memory a bounded number of times regardless of W:
// rank r reduces piece r of the chunk from all slots (reduce-scatter), then every rank
// copies every reduced piece out (all-gather). A rank stages only the pieces that other
// ranks reduce; its own piece is read straight from its input.
void allreduce_chunked(Comm& c, char* data, size_t count, c10::ScalarType dtype, ReduceOp op) {
  const size_t es = element_size(dtype);
  const size_t chunk = c.arena.slot_bytes() / es;
  const int me = c.rank();
  std::vector<const void*> srcs(c.size());
  for (size_t off = 0; off < count; off += chunk) {
    const size_t n = std::min(chunk, count - off);
    char* in = data + off * es;
    if (off > 0) c.wait_slot_free();
    for (int r = 0; r < c.size(); ++r) {
      Piece p = piece_of(n, c.size(), r);
      if (r != me) std::memcpy(c.arena.slot(me) + p.begin * es, in + p.begin * es, p.size() * es);
    }
    c.arrive_and_wait();
    if (off == 0) c.check_descriptors();

    Piece mine = piece_of(n, c.size(), me);
    for (int r = 0; r < c.size(); ++r) {
      srcs[r] = (r == me ? in : c.arena.slot(r)) + mine.begin * es;
    }
    reduce(dtype, op, c.arena.slot(me) + mine.begin * es, srcs.data(), c.size(), mine.size(), c.size());
    c.arrive_and_wait();

    for (int r = 0; r < c.size(); ++r) {
      Piece p = piece_of(n, c.size(), r);
      std::memcpy(in + p.begin * es, c.arena.slot(r) + p.begin * es, p.size() * es);
    }
    c.arrive();
  }
}

}  // namespace

void allreduce(Comm& c, void* data, size_t count, c10::ScalarType dtype, ReduceOp op) {
  check_supported(op, dtype);
  shm::OpDesc desc;
  desc.op = static_cast<uint32_t>(OpKind::kAllreduce);
  desc.dtype = static_cast<int32_t>(dtype);
  desc.reduce_op = static_cast<int32_t>(op);
  desc.count = count;
  c.begin(desc);
  size_t bytes = count * element_size(dtype);
  if (count == 0 || (bytes <= static_cast<size_t>(c.config.oneshot_max_bytes) &&
                     bytes <= c.arena.slot_bytes())) {
    allreduce_oneshot(c, static_cast<char*>(data), count, dtype, op);
  } else {
    allreduce_chunked(c, static_cast<char*>(data), count, dtype, op);
  }
}

}  // namespace torchpar::collectives
