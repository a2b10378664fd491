#include <algorithm>
#include <cstring>

#include "collectives/collectives.h"

namespace torchpar::collectives {

// The root stages a chunk in its slot; everyone else copies it out. Non-roots only wait
// for the root, not for each other.
void broadcast(Comm& c, void* data, size_t count, c10::ScalarType dtype, int root) {
  shm::OpDesc desc;
  desc.op = static_cast<uint32_t>(OpKind::kBroadcast);
  desc.dtype = static_cast<int32_t>(dtype);
  desc.root = root;
  desc.count = count;
  c.begin(desc);
  const size_t es = element_size(dtype);
  const size_t chunk = c.arena.slot_bytes() / es;
  char* bytes = static_cast<char*>(data);
  size_t off = 0;
  do {
    const size_t n = std::min(chunk, count - off);
    if (off > 0 && c.rank() == root) c.wait_slot_free();
    if (c.rank() == root) std::memcpy(c.arena.slot(root), bytes + off * es, n * es);
    if (off == 0) {
      c.arrive_and_wait();
      c.check_descriptors();
    } else {
      c.arrive();
      if (c.rank() != root) c.wait_for(root);
    }
    if (c.rank() != root) std::memcpy(bytes + off * es, c.arena.slot(root), n * es);
    c.arrive();
    off += n;
  } while (off < count);
}

}  // namespace torchpar::collectives
