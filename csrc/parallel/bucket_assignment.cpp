#include "parallel/bucket_assignment.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace torchpar::parallel {

std::vector<std::vector<int64_t>> assign_buckets(const std::vector<at::Tensor>& params,
                                                 int64_t cap_bytes, int64_t first_cap_bytes,
                                                 std::optional<at::ScalarType> reduce_dtype,
                                                 const std::vector<int64_t>& order,
                                                 const std::vector<bool>& sparse) {
  TORCH_CHECK(cap_bytes >= 0 && first_cap_bytes >= 0,
              "torchpar DDP: bucket caps must be >= 0, got ", cap_bytes, " and ", first_cap_bytes);
  const int64_t n = static_cast<int64_t>(params.size());
  std::vector<int64_t> fill = order;
  if (fill.empty()) {
    for (int64_t i = n - 1; i >= 0; --i) {
      fill.push_back(i);
    }
  }
  std::vector<bool> seen(n, false);
  for (int64_t i : fill) {
    TORCH_CHECK(i >= 0 && i < n && !seen[i], "torchpar DDP: bucket order must list each of the ", n,
                " parameters once; bad entry ", i);
    seen[i] = true;
  }
  TORCH_CHECK(static_cast<int64_t>(fill.size()) == n, "torchpar DDP: bucket order lists ",
              fill.size(), " of ", n, " parameters");
  TORCH_CHECK(sparse.empty() || static_cast<int64_t>(sparse.size()) == n, "torchpar DDP: ", sparse.size(),
              " sparse flags for ", n, " parameters");
  std::vector<std::vector<int64_t>> buckets;
  std::vector<int64_t> open;
  int64_t open_bytes = 0;
  auto close = [&] {
    if (!open.empty()) {
      buckets.push_back(std::move(open));
      open.clear();
      open_bytes = 0;
    }
  };
  for (int64_t i : fill) {
    const at::Tensor& p = params[i];
    if (!sparse.empty() && sparse[i]) {
      close();
      buckets.push_back({i});
      continue;
    }
    // One flat tensor per bucket means one dtype and one device per bucket.
    if (!open.empty()) {
      const at::Tensor& q = params[open.front()];
      if (q.scalar_type() != p.scalar_type() || q.device() != p.device()) {
        close();
      }
    }
    open.push_back(i);
    open_bytes += p.numel() * static_cast<int64_t>(c10::elementSize(reduce_dtype.value_or(p.scalar_type())));
    const int64_t cap = buckets.empty() ? first_cap_bytes : cap_bytes;
    if (open_bytes >= cap) {
      close();
    }
  }
  close();
  return buckets;
}

std::vector<BucketShards> shard_buckets(const std::vector<at::Tensor>& params,
                                        const std::vector<std::vector<int64_t>>& buckets,
                                        int64_t world_size) {
  TORCH_CHECK(world_size >= 1, "torchpar ZeRO: world size must be >= 1, got ", world_size);
  const int64_t n = static_cast<int64_t>(params.size());
  std::vector<int64_t> total(world_size, 0);  // elements per rank over all buckets so far
  std::vector<BucketShards> out;
  for (const auto& bucket : buckets) {
    for (int64_t i : bucket) {
      TORCH_CHECK(i >= 0 && i < n, "torchpar ZeRO: bucket index ", i, " out of range");
    }
    // Elements, not bytes: a bucket holds one dtype, so the two orders agree.
    std::vector<int64_t> by_size(bucket.begin(), bucket.end());
    std::stable_sort(by_size.begin(), by_size.end(),
                     [&](int64_t a, int64_t b) { return params[a].numel() > params[b].numel(); });
    std::vector<int64_t> load(world_size, 0);
    std::vector<int64_t> owner(n, -1);
    for (int64_t i : by_size) {
      int64_t best = 0;
      for (int64_t r = 1; r < world_size; ++r) {
        if (load[r] < load[best] || (load[r] == load[best] && total[r] < total[best])) {
          best = r;
        }
      }
      owner[i] = best;
      load[best] += params[i].numel();
      total[best] += params[i].numel();
    }
    BucketShards s;
    s.shard_numel = *std::max_element(load.begin(), load.end());
    for (int64_t r = 0; r < world_size; ++r) {
      int64_t offset = r * s.shard_numel;
      for (int64_t i : bucket) {
        if (owner[i] == r) {
          s.params.push_back(i);
          s.owners.push_back(r);
          s.offsets.push_back(offset);
          offset += params[i].numel();
        }
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace torchpar::parallel
