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
// and the reduction work is spread over all ranks.
void reduce_in_chunks(Comm& c, char* data, size_t count, c10::ScalarType dtype, ReduceOp op, int root) {
  const size_t es = element_size(dtype);
  const size_t chunk = c.arena.slot_bytes() / es;
  const int me = c.rank();
  const bool receives = root < 0 || me == root;
  std::vector<const void*> srcs(c.size());
  size_t off = 0;
  do {
    const size_t n = std::min(chunk, count - off);
    char* in = data + off * es;
    if (off > 0) c.wait_slot_free();
    for (int r = 0; r < c.size(); ++r) {
      Piece p = piece_of(n, c.size(), r);
      if (r != me) stream_copy(c.arena.slot(me) + p.begin * es, in + p.begin * es, p.size() * es);
    }
    c.arrive_and_wait();
    if (off == 0) c.check_descriptors();

    Piece mine = piece_of(n, c.size(), me);
    for (int r = 0; r < c.size(); ++r) srcs[r] = (r == me ? in : c.arena.slot(r)) + mine.begin * es;
    char* my_piece = c.arena.slot(me) + mine.begin * es;
    if (receives) {
      // Reduce straight into the output; publish the piece for the other receivers.
      reduce(dtype, op, in + mine.begin * es, srcs.data(), c.size(), mine.size(), c.size());
      if (root < 0) stream_copy(my_piece, in + mine.begin * es, mine.size() * es);
    } else {
      reduce(dtype, op, my_piece, srcs.data(), c.size(), mine.size(), c.size());  // input untouched
    }
    if (receives) {
      c.arrive_and_wait();
      for (int r = 0; r < c.size(); ++r) {
        Piece p = piece_of(n, c.size(), r);
        if (r != me) std::memcpy(in + p.begin * es, c.arena.slot(r) + p.begin * es, p.size() * es);
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
  c.begin(op_desc(OpKind::kReduce, dtype, count, root, static_cast<int>(op)));
  reduce_in_chunks(c, static_cast<char*>(data), count, dtype, op, root);
}

}  // namespace torchpar::collectives
