// dst = src with the kernels' non-temporal stores: the bench's copy roofline for kernels that
// write their outputs that way (a plain `dst.copy_(src)` first reads every line it writes).
#include <ATen/Parallel.h>

#include "kernels/cpu/kernels.h"
#include "kernels/cpu/vec.h"

namespace torchpar::kernels::cpu::CPU_CAPABILITY {

void copy_streaming(at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(src.scalar_type() == at::kFloat && dst.scalar_type() == at::kFloat &&
                  src.is_cpu() && dst.is_cpu() && src.is_contiguous() && dst.is_contiguous() &&
                  src.numel() == dst.numel(),
              "torchpar.copy_streaming_: dst and src must be contiguous float32 CPU tensors of "
              "one size, got ", dst.sizes(), " ", dst.scalar_type(), " and ", src.sizes(), " ",
              src.scalar_type());
  using IO = VecIO<float>;
  using Vec = IO::Vec;
  const float* s = src.const_data_ptr<float>();
  float* d = dst.mutable_data_ptr<float>();
  at::parallel_for(0, src.numel(), int64_t(1) << 16, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i < end && !streams_at(d + i); ++i) d[i] = s[i];  // up to an aligned destination
    for (; i + IO::kStep <= end; i += IO::kStep) {
      Vec a, b;
      IO::load2(s + i, a, b);
      IO::store2(d + i, a, b, /*stream=*/true);
    }
    for (; i < end; ++i) d[i] = s[i];
    stream_fence(true);
  });
}

}  // namespace torchpar::kernels::cpu::CPU_CAPABILITY
