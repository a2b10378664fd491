#include <algorithm>
#include <cstring>

#include "collectives/collectives.h"
#include "collectives/stream_copy.h"

namespace torchpar::collectives {
namespace {

// Each rank stages a chunk of its input; the receiving ranks copy every slot out.
void gather_chunks(Comm& c, OpKind kind, const void* in, void* const* outs, size_t count,
                   c10::ScalarType dtype, int root) {
  c.begin(op_desc(kind, dtype, count, root));
  const size_t es = element_size(dtype);
  const size_t chunk = c.arena().slot_bytes() / es;
  const bool receives = root < 0 || c.rank() == root;
  size_t off = 0;
  do {
    const size_t n = std::min(chunk, count - off);
    if (off > 0) c.wait_slot_free();
    stream_copy(c.arena().slot(c.rank()), static_cast<const char*>(in) + off * es, n * es);
    if (receives || off == 0) {
      c.arrive_and_wait();
    } else {
      c.arrive();
    }
    if (off == 0) c.check_descriptors();
    if (receives) {
      for (int r = 0; r < c.size(); ++r) {
        // In place, this rank's block is its input already (and may still be being sent from).
        if (r == c.rank() && outs[r] == in) continue;
        std::memcpy(static_cast<char*>(outs[r]) + off * es, c.arena().slot(r), n * es);
      }
    }
    c.arrive();
    off += n;
  } while (off < count);
}

}  // namespace

void allgather(Comm& c, const void* in, void* const* outs, size_t count, c10::ScalarType dtype) {
  if (!c.shared) {
    if (c.hierarchy != nullptr && c.members == nullptr) return hier::allgather(c, in, outs, count, dtype);
    return p2p::allgather(c, in, outs, count, dtype);
  }
  gather_chunks(c, OpKind::kAllgather, in, outs, count, dtype, -1);
}

void gather(Comm& c, const void* in, void* const* outs, size_t count, c10::ScalarType dtype, int root) {
  if (!c.shared) return p2p::gather(c, in, outs, count, dtype, root);
  gather_chunks(c, OpKind::kGather, in, outs, count, dtype, root);
}

}  // namespace torchpar::collectives
