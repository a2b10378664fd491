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
// each parameter's dtype. A parameter flagged in `sparse` (it gets sparse gradients,
// nn.Embedding(sparse=True)) has a bucket of its own: a sparse gradient has no place in a flat
// tensor, and is reduced by itself (torch's DDP does the same).
std::vector<std::vector<int64_t>> assign_buckets(const std::vector<at::Tensor>& params,
                                                 int64_t cap_bytes, int64_t first_cap_bytes,
                                                 std::optional<at::ScalarType> reduce_dtype,
                                                 const std::vector<int64_t>& order = {},
                                                 const std::vector<bool>& sparse = {});

// One bucket split into whole-parameter shards, one per rank, for ZeRO (Rajbhandari et al.
// 2020, arXiv:1910.02054). The bucket's flat tensor is `world_size` equal segments of
// `shard_numel` elements; rank r's parameters lie back to back in segment r, the rest of the
// segment is padding. A reduce-scatter of the flat tensor then leaves each rank the summed
// gradients of exactly its own parameters, and an all-gather into it brings every rank's
// updated parameters back: ZeRO-2's DDP and the ZeRO optimizer share this one layout.
struct BucketShards {
  std::vector<int64_t> params;  // parameter indices, rank 0's first, each rank's in bucket order
  std::vector<int64_t> owners;  // rank owning params[k]
  std::vector<int64_t> offsets; // element offset of params[k] in the flat tensor
  int64_t shard_numel = 0;      // elements per rank's segment (the largest rank's, padded to)
};

// Splits each bucket among `world_size` ranks, balanced by size: parameters taken largest
// first, each to the rank with the fewest elements in this bucket (ties: the fewest over all
// buckets so far, then the lowest rank). Deterministic, so every rank computes the same.
std::vector<BucketShards> shard_buckets(const std::vector<at::Tensor>& params,
                                        const std::vector<std::vector<int64_t>>& buckets,
                                        int64_t world_size);

}  // namespace torchpar::parallel
