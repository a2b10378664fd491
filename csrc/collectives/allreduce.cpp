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

}  // namespace

void allreduce(Comm& c, void* data, size_t count, c10::ScalarType dtype, ReduceOp op) {
  check_supported(op, dtype);
  c.begin(op_desc(OpKind::kAllreduce, dtype, count, 0, static_cast<int>(op)));
  size_t bytes = count * element_size(dtype);
  if (count == 0 || (bytes <= static_cast<size_t>(c.config.oneshot_max_bytes) &&
                     bytes <= c.arena.slot_bytes())) {
    allreduce_oneshot(c, static_cast<char*>(data), count, dtype, op);
  } else {
    reduce_in_chunks(c, static_cast<char*>(data), count, dtype, op, /*root=*/-1);
  }
}

}  // namespace torchpar::collectives
