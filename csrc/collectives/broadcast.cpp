#include <algorithm>
#include <cstring>

#include "collectives/collectives.h"
#include "collectives/stream_copy.h"

namespace torchpar::collectives {

// The root stages chunks in its slot; everyone else copies them out. The slot is split in
// two halves so the root writes chunk c+1 while the others still copy chunk c: a pipeline
// of two copies instead of their sum. Each chunk takes two steps on every rank:
// "staged" (the root wrote it) and "read" (a receiver copied it out).
void broadcast(Comm& c, const Segments& data, size_t count, c10::ScalarType dtype, int root) {
  c.begin(op_desc(OpKind::kBroadcast, dtype, count, root));
  const size_t es = element_size(dtype);
  const size_t half = c.arena().slot_bytes() / 2;
  const size_t chunk = std::max<size_t>(1, half / es);
  const bool is_root = c.rank() == root;
  size_t off = 0;
  for (size_t k = 0; k == 0 || off < count; ++k) {
    const size_t n = std::min(chunk, count - off);
    char* staging = c.arena().slot(root) + (k % 2) * half;
    if (is_root) {
      // Half k%2 last held chunk k-2: wait until every receiver has read it.
      if (k >= 2) c.arena().wait_all(c.arena().step() - 2, c.deadline, c.busy_wait);
      data.gather(staging, off * es, n * es, true);
    }
    if (k == 0) {
      c.arrive_and_wait();
      c.check_descriptors();
    } else {
      c.arrive();
      if (!is_root) c.wait_for(root);
    }
    if (!is_root) data.scatter(off * es, staging, n * es);
    c.arrive();
    off += n;
  }
}

void broadcast(Comm& c, void* data, size_t count, c10::ScalarType dtype, int root) {
  if (!c.shared) {
    if (c.hierarchy != nullptr && c.members == nullptr) return hier::broadcast(c, data, count, dtype, root);
    return p2p::broadcast(c, data, count, dtype, root);
  }
  broadcast(c, Segments(data, count * element_size(dtype)), count, dtype, root);
}

}  // namespace torchpar::collectives
