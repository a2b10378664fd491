#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/collectives.h"

namespace torchpar::collectives {

// Reduce-scatter through the arena (rank r reduces piece r of each chunk from all slots),
// then only the root gathers the reduced pieces: the work is spread over all ranks instead
// of the root reading W full buffers alone.
void reduce(Comm& c, void* data, size_t count, c10::ScalarType dtype, ReduceOp op, int root) {
  check_supported(op, dtype);
  shm::OpDesc desc;
  desc.op = static_cast<uint32_t>(OpKind::kReduce);
  desc.dtype = static_cast<int32_t>(dtype);
  desc.reduce_op = static_cast<int32_t>(op);
  desc.root = root;
  desc.count = count;
  c.begin(desc);
  const size_t es = element_size(dtype);
  const size_t chunk = c.arena.slot_bytes() / es;
  const int me = c.rank();
  char* bytes = static_cast<char*>(data);
  std::vector<const void*> srcs(c.size());
  size_t off = 0;
  do {
    const size_t n = std::min(chunk, count - off);
    char* in = bytes + off * es;
    if (off > 0) c.wait_slot_free();
    for (int r = 0; r < c.size(); ++r) {
      Piece p = piece_of(n, c.size(), r);
      if (r != me) std::memcpy(c.arena.slot(me) + p.begin * es, in + p.begin * es, p.size() * es);
    }
    c.arrive_and_wait();
    if (off == 0) c.check_descriptors();

    Piece mine = piece_of(n, c.size(), me);
    for (int r = 0; r < c.size(); ++r) srcs[r] = (r == me ? in : c.arena.slot(r)) + mine.begin * es;
    reduce(dtype, op, c.arena.slot(me) + mine.begin * es, srcs.data(), c.size(), mine.size(), c.size());
    if (me == root) {
      c.arrive_and_wait();
      for (int r = 0; r < c.size(); ++r) {
        Piece p = piece_of(n, c.size(), r);
        std::memcpy(in + p.begin * es, c.arena.slot(r) + p.begin * es, p.size() * es);
      }
    } else {
      c.arrive();
    }
    c.arrive();
    off += n;
  } while (off < count);
}

}  // namespace torchpar::collectives
