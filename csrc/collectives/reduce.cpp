#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/stream_copy.h"

namespace torchpar::collectives {

// Reduce-scatter through the arena, then a gather to the receivers, chunk by chunk. Rank r
// stages the pieces of its chunk that other ranks reduce (its own piece it reads straight
// from its input), reduces piece r from all slots into its slot, and the receivers copy
// every reduced piece out. Each byte crosses memory a bounded number of times, whatever W,
// and the reduction work is spread over all ranks. The input may be several buffers
// (Segments): a reduction then runs once per contiguous span.
void reduce_in_chunks(Comm& c, const Segments& data, size_t count, c10::ScalarType dtype, ReduceOp op,
                      int root) {
  const size_t es = element_size(dtype);
  const size_t chunk = c.arena().slot_bytes() / es;
  const int me = c.rank();
  const bool receives = root < 0 || me == root;
  std::vector<const void*> srcs(c.size());
  size_t off = 0;
  do {
    const size_t n = std::min(chunk, count - off);
    const size_t base = off * es;  // the chunk's first byte in `data`
    if (off > 0) c.wait_slot_free();
    for (int r = 0; r < c.size(); ++r) {
      Piece p = piece_of(n, c.size(), r);
      if (r != me) data.gather(c.arena().slot(me) + p.begin * es, base + p.begin * es, p.size() * es, true);
    }
    c.arrive_and_wait();
    if (off == 0) c.check_descriptors();

    Piece mine = piece_of(n, c.size(), me);
    char* my_piece = c.arena().slot(me) + mine.begin * es;
    data.for_each(base + mine.begin * es, mine.size() * es, [&](char* in, size_t at, size_t bytes) {
      for (int r = 0; r < c.size(); ++r) srcs[r] = r == me ? in : c.arena().slot(r) + mine.begin * es + at;
      // Receivers reduce straight into the output; the others into their slot (input untouched).
      reduce(dtype, op, receives ? in : my_piece + at, srcs.data(), c.size(), bytes / es, c.size());
    });
    if (receives) {
      // Publish the piece for the other receivers, then take theirs.
      if (root < 0) data.gather(my_piece, base + mine.begin * es, mine.size() * es, true);
      c.arrive_and_wait();
      for (int r = 0; r < c.size(); ++r) {
        Piece p = piece_of(n, c.size(), r);
        if (r != me) data.scatter(base + p.begin * es, c.arena().slot(r) + p.begin * es, p.size() * es);
      }
    } else {
      c.arrive();
    }
    c.arrive();
    off += n;
  } while (off < count);
}

void reduce(Comm& c, void* data, size_t count, c10::ScalarType dtype, ReduceOp op, int root) {
  check_supported(op, dtype);
  if (!c.shared) {
    if (c.hierarchy != nullptr && c.members == nullptr && !hier::reduces_flat(dtype, op)) {
      return hier::reduce(c, data, count, dtype, op, root);
    }
    return p2p::reduce(c, data, count, dtype, op, root);
  }
  c.begin(op_desc(OpKind::kReduce, dtype, count, root, static_cast<int>(op)));
  reduce_in_chunks(c, Segments(data, count * element_size(dtype)), count, dtype, op, root);
}

}  // namespace torchpar::collectives
