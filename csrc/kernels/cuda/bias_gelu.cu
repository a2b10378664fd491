// bias + GeLU on CUDA. Forward: a grid-stride loop over packs of N elements (16-byte loads).
// Backward: threads own a pack of columns and walk a chunk of rows, so dx streams out
// coalesced while dbias accumulates in registers; sum_partials folds the chunks.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/cuda/common.cuh"
#include "kernels/gelu.h"
#include "kernels/ops.h"

namespace torchpar::kernels::cuda {
namespace {

using at::Tensor;

template <typename T, int N, GeluApprox A>
__global__ void forward_kernel(const T* __restrict__ x, const at::opmath_type<T>* __restrict__ bias,
                               T* __restrict__ y, int64_t packs, int64_t cols) {
  using acc_t = at::opmath_type<T>;
  using P = Pack<T, N>;
  const P* xp = reinterpret_cast<const P*>(x);
  P* yp = reinterpret_cast<P*>(y);
  for (int64_t q = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; q < packs;
       q += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c0 = (q * N) % cols;
    P v = xp[q], o;
#pragma unroll
    for (int j = 0; j < N; ++j) o.v[j] = T(gelu<acc_t>(acc_t(v.v[j]) + bias[c0 + j], A));
    yp[q] = o;
  }
}

// kDbias: also sum each chunk's dbias into db_part (null otherwise).
template <typename T, int N, GeluApprox A, bool kDbias>
__global__ void backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                const at::opmath_type<T>* __restrict__ bias, T* __restrict__ dx,
                                at::opmath_type<T>* __restrict__ db_part, int64_t rows,
                                int64_t cols) {
  using acc_t = at::opmath_type<T>;
  using P = Pack<T, N>;
  const int64_t c0 = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * N;
  if (c0 >= cols) return;
  const int64_t chunk = (rows + gridDim.y - 1) / gridDim.y;
  const int64_t r0 = blockIdx.y * chunk, r1 = min(rows, r0 + chunk);
  acc_t b[N], s[N];
#pragma unroll
  for (int j = 0; j < N; ++j) {
    b[j] = bias[c0 + j];
    s[j] = 0;
  }
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t off = r * cols + c0;
    P d = *reinterpret_cast<const P*>(dy + off), v = *reinterpret_cast<const P*>(x + off), o;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const acc_t g = acc_t(d.v[j]) * gelu_grad<acc_t>(acc_t(v.v[j]) + b[j], A);
      o.v[j] = T(g);
      if constexpr (kDbias) s[j] += g;
    }
    *reinterpret_cast<P*>(dx + off) = o;
  }
  if constexpr (kDbias) {
#pragma unroll
    for (int j = 0; j < N; ++j) db_part[blockIdx.y * cols + c0 + j] = s[j];
  }
}

Tensor bias_gelu_cuda(const Tensor& input, const Tensor& bias, c10::string_view approximate) {
  const GeluApprox approx = parse_gelu_approx(approximate);
  c10::cuda::CUDAGuard guard(input.device());
  const auto [x, b, unused, shape] = prepare_bias_op("bias_gelu", input, bias, nullptr);
  const auto [rows, cols] = shape;
  Tensor y = at::empty_like(x);
  if (x.numel() == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_gelu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int n = pack_width<scalar_t>(cols, {x.const_data_ptr(), y.const_data_ptr()});
    with_pack<scalar_t>(n, [&](auto pack) {
      constexpr int N = decltype(pack)::value;
      with_gelu_approx(approx, [&](auto a) {
        const int64_t packs = x.numel() / N;
        const int threads = 256;
        forward_kernel<scalar_t, N, decltype(a)::value>
            <<<elementwise_blocks(packs, threads), threads, 0, at::cuda::getCurrentCUDAStream()>>>(
                x.const_data_ptr<scalar_t>(), b.const_data_ptr<acc_t>(),
                y.mutable_data_ptr<scalar_t>(), packs, cols);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  return y;
}

std::tuple<Tensor, Tensor> bias_gelu_bwd_cuda(const Tensor& grad_out, const Tensor& input,
                                              const Tensor& bias, c10::string_view approximate,
                                              bool bias_grad) {
  const GeluApprox approx = parse_gelu_approx(approximate);
  c10::cuda::CUDAGuard guard(input.device());
  const auto [x, b, unused, shape] = prepare_bias_op("bias_gelu", input, bias, nullptr);
  const auto [rows, cols] = shape;
  const Tensor dy = prepare_grad("bias_gelu", grad_out, x);
  const auto acc = at::toOpMathType(x.scalar_type());
  Tensor dx = at::empty_like(x);
  Tensor db = at::empty({bias_grad ? cols : 0}, bias.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_gelu_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int n = pack_width<scalar_t>(cols, {x.const_data_ptr(), dy.const_data_ptr(),
                                             dx.const_data_ptr()});
    with_pack<scalar_t>(n, [&](auto pack) {
      constexpr int N = decltype(pack)::value;
      const int threads = 128;
      const dim3 grid = column_tile_grid(rows, cols, threads * N);
      Tensor part = column_partials(bias_grad ? int64_t(grid.y) : 0, cols, x.numel() > 0,
                                    x.options().dtype(acc));
      if (x.numel() > 0) {
        with_gelu_approx(approx, [&](auto a) {
          with_flag(bias_grad, [&](auto sum) {
            backward_kernel<scalar_t, N, decltype(a)::value, decltype(sum)::value>
                <<<grid, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
                    dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                    b.const_data_ptr<acc_t>(), dx.mutable_data_ptr<scalar_t>(),
                    bias_grad ? part.mutable_data_ptr<acc_t>() : nullptr, rows, cols);
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
        });
      }
      if (bias_grad) sum_partials<scalar_t, acc_t>(part, db);
    });
  });
  return {dx, db};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchpar, CUDA, m) {
  m.impl("bias_gelu", &bias_gelu_cuda);
  m.impl("bias_gelu_bwd", &bias_gelu_bwd_cuda);
}

}  // namespace torchpar::kernels::cuda
