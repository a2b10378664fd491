// all_reduce of sparse COO tensors (SUM only, as gloo): see sparse.cpp.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "collectives/comm.h"

namespace torchpar {

// On the calling thread: device, dtype and op; raises for anything else.
void check_sparse_allreduce(const at::Tensor& t, const c10d::ReduceOp& op);
// On every rank of the group, in the collective queue: `t` becomes the sum of every rank's
// `t` (coalesced), in place.
void sparse_allreduce_sum(collectives::Comm& c, const at::Tensor& t);

}  // namespace torchpar
