// Which parameters share a DDP bucket.
//
// Backward produces gradients roughly in the reverse of registration order (the last
// layer's first), so buckets are filled walking the parameters backwards: the first
// bucket then becomes ready early and its all-reduce overlaps the rest of backward.
// The first bucket is kept small so that overlap starts as soon as possible (the same
// reason torch's DDP uses a 1 MiB first bucket, pytorch/pytorch#73732).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace torchpar::parallel {

// Returns bucket -> parameter indices. Parameters are taken in `order` (every index once),
// or in reverse registration order when `order` is empty. A bucket holds parameters of
// one dtype and one device and closes once it reaches `first_cap_bytes` (the first
// bucket) or `cap_bytes` (the others); a cap of 0 puts every parameter in its own bucket.
// Sizes are counted in `reduce_dtype` when given (the dtype the bucket will hold), else in
// each parameter's dtype.
std::vector<std::vector<int64_t>> assign_buckets(const std::vector<at::Tensor>& params,
                                                 int64_t cap_bytes, int64_t first_cap_bytes,
                                                 std::optional<at::ScalarType> reduce_dtype,
                                                 const std::vector<int64_t>& order = {});

}  // namespace torchpar::parallel
