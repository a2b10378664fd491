#include <cstring>
#include <vector>

#include "collectives/collectives.h"
#include "common/error.h"

namespace torchpar::collectives {
namespace {

// Below ~64 KiB the cost is synchronisation, not bandwidth: one barrier, then each rank
// reads all W slots and computes the whole result itself. Its own operand comes straight
// from its input (bit-identical to its slot, so every rank still sums the same values in
// the same order).
void allreduce_oneshot(Comm& c, const Segments& data, size_t count, c10::ScalarType dtype, ReduceOp op) {
  const size_t es = element_size(dtype);
  data.gather(c.arena().slot(c.rank()), 0, count * es, false);
  c.arrive_and_wait();
  c.check_descriptors();
  std::vector<const void*> srcs(c.size());
  data.for_each(0, count * es, [&](char* in, size_t at, size_t bytes) {
    for (int r = 0; r < c.size(); ++r) srcs[r] = r == c.rank() ? in : c.arena().slot(r) + at;
    reduce(dtype, op, in, srcs.data(), c.size(), bytes / es, c.size());
  });
  c.arrive();
}

}  // namespace

void allreduce(Comm& c, const Segments& data, size_t count, c10::ScalarType dtype, ReduceOp op) {
  const size_t bytes = count * element_size(dtype);
  TP_CHECK_USAGE(data.bytes() == bytes, "all_reduce of ", count, " elements given ", data.bytes(),
                 " bytes of buffers");
  check_supported(op, dtype);
  if (!c.shared) {
    // (float16 sums stay flat across hosts: hier::reduces_flat.)
    if (c.hierarchy != nullptr && c.members == nullptr && !hier::reduces_flat(dtype, op)) {
      return hier::allreduce(c, data, count, dtype, op);
    }
    return p2p::allreduce(c, data, count, dtype, op);
  }
  c.begin(op_desc(OpKind::kAllreduce, dtype, count, 0, static_cast<int>(op)));
  if (count == 0 || (bytes <= static_cast<size_t>(c.config.oneshot_max_bytes) &&
                     bytes <= c.arena().slot_bytes())) {
    allreduce_oneshot(c, data, count, dtype, op);
  } else {
    reduce_in_chunks(c, data, count, dtype, op, /*root=*/-1);
  }
}

void allreduce(Comm& c, void* data, size_t count, c10::ScalarType dtype, ReduceOp op) {
  allreduce(c, Segments(data, count * element_size(dtype)), count, dtype, op);
}

}  // namespace torchpar::collectives
