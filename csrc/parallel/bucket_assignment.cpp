#include "parallel/bucket_assignment.h"

#include <c10/util/Exception.h>

namespace torchpar::parallel {

std::vector<std::vector<int64_t>> assign_buckets(const std::vector<at::Tensor>& params,
                                                 int64_t cap_bytes, int64_t first_cap_bytes,
                                                 std::optional<at::ScalarType> reduce_dtype,
                                                 const std::vector<int64_t>& order) {
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

}  // namespace torchpar::parallel
