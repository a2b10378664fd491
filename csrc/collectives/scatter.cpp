#include <algorithm>
#include <cstring>

#include "collectives/collectives.h"
#include "collectives/stream_copy.h"

namespace torchpar::collectives {

// The root stages piece r of each chunk at offset r of its slot; rank r copies it out.
void scatter(Comm& c, const void* const* ins, void* out, size_t count, c10::ScalarType dtype, int root) {
  if (!c.shared) return p2p::scatter(c, ins, out, count, dtype, root);
  c.begin(op_desc(OpKind::kScatter, dtype, count, root));
  const size_t es = element_size(dtype);
  const size_t chunk = std::max<size_t>(1, c.arena().slot_bytes() / (es * c.size()));
  const int me = c.rank();
  char* dst = static_cast<char*>(out);
  size_t off = 0;
  do {
    const size_t n = std::min(chunk, count - off);
    if (me == root) {
      if (off > 0) c.wait_slot_free();
      for (int r = 0; r < c.size(); ++r) {
        if (r != root) {
          stream_copy(c.arena().slot(root) + r * chunk * es,
                      static_cast<const char*>(ins[r]) + off * es, n * es);
        }
      }
      std::memcpy(dst + off * es, static_cast<const char*>(ins[root]) + off * es, n * es);
    }
    if (off == 0) {
      c.arrive_and_wait();
      c.check_descriptors();
    } else {
      c.arrive();
      if (me != root) c.wait_for(root);
    }
    if (me != root) std::memcpy(dst + off * es, c.arena().slot(root) + me * chunk * es, n * es);
    c.arrive();
    off += n;
  } while (off < count);
}

}  // namespace torchpar::collectives
