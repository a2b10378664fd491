#include "collectives/collectives.h"

namespace torchpar::collectives {

void barrier(Comm& c) {
  shm::OpDesc desc;
  desc.op = static_cast<uint32_t>(OpKind::kBarrier);
  c.begin(desc);
  c.arrive_and_wait();
  c.check_descriptors();
  c.arrive();
}

}  // namespace torchpar::collectives
