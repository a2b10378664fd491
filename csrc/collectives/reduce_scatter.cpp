#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/collectives.h"
#include "collectives/stream_copy.h"

namespace torchpar::collectives {

// Rank q stages, at offset r of its slot, the chunk of its input destined for rank r;
// rank r then reduces offset r of every slot (its own piece straight from its input).
void reduce_scatter(Comm& c, const void* const* ins, void* out, size_t count, c10::ScalarType dtype,
                    ReduceOp op) {
  check_supported(op, dtype);
  if (!c.shared) {
    if (c.hierarchy != nullptr && c.members == nullptr && !hier::reduces_flat(dtype, op)) {
      return hier::reduce_scatter(c, ins, out, count, dtype, op);
    }
    return p2p::reduce_scatter(c, ins, out, count, dtype, op);
  }
  c.begin(op_desc(OpKind::kReduceScatter, dtype, count, 0, static_cast<int>(op)));
  const size_t es = element_size(dtype);
  const size_t chunk = std::max<size_t>(1, c.arena().slot_bytes() / (es * c.size()));
  const int me = c.rank();
  std::vector<const void*> srcs(c.size());
  size_t off = 0;
  do {
    const size_t n = std::min(chunk, count - off);
    if (off > 0) c.wait_slot_free();
    for (int r = 0; r < c.size(); ++r) {
      if (r != me) {
        stream_copy(c.arena().slot(me) + r * chunk * es, static_cast<const char*>(ins[r]) + off * es, n * es);
      }
    }
    c.arrive_and_wait();
    if (off == 0) c.check_descriptors();
    for (int q = 0; q < c.size(); ++q) {
      srcs[q] = q == me ? static_cast<const char*>(ins[me]) + off * es : c.arena().slot(q) + me * chunk * es;
    }
    reduce(dtype, op, static_cast<char*>(out) + off * es, srcs.data(), c.size(), n, c.size());
    c.arrive();
    off += n;
  } while (off < count);
}

}  // namespace torchpar::collectives
