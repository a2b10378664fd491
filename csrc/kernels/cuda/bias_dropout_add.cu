// bias + dropout + residual add on CUDA. Each thread draws the Philox blocks covering its
// pack (one block per 8 elements, dropout.h's rule), so the mask needs no memory at all.
// Forward: grid-stride over packs. Backward: column tiles, as in bias_gelu.cu, so dbias
// is summed in registers while dx streams out.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/PhiloxUtils.cuh>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/cuda/common.cuh"
#include "kernels/dropout.h"
#include "kernels/ops.h"

namespace torchpar::kernels::cuda {
namespace {

using at::Tensor;

// Multipliers (scale or 0) of elements i .. i+N-1.
template <typename acc_t, int N>
__device__ __forceinline__ void pack_multipliers(uint64_t seed, uint64_t threshold, acc_t scale,
                                                 uint64_t i, acc_t (&m)[N]) {
  Philox4x32 blk = dropout_block(seed, i);
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const uint64_t e = i + j;
    if (j > 0 && e % kDropoutElemsPerBlock == 0) blk = dropout_block(seed, e);
    m[j] = dropout_keep(blk, e, threshold) ? scale : acc_t(0);
  }
}

template <typename T, int N, bool Active>
__global__ void forward_kernel(const T* __restrict__ x, const at::opmath_type<T>* __restrict__ bias,
                               const T* __restrict__ res, T* __restrict__ out, int64_t packs,
                               int64_t cols, at::PhiloxCudaState philox, uint64_t threshold,
                               double scale, int64_t* __restrict__ seed_out) {
  using acc_t = at::opmath_type<T>;
  using P = Pack<T, N>;
  // Outside a graph `philox` carries the host's key as its seed; inside, the CUDA generator's
  // (seed, offset), read here at replay time. The backward reads the key from seed_out.
  const auto [philox_seed, philox_offset] = at::cuda::philox::unpack(philox);
  const uint64_t seed = philox.captured_ ? dropout_graph_key(philox_seed, philox_offset) : philox_seed;
  if (blockIdx.x == 0 && threadIdx.x == 0) *seed_out = static_cast<int64_t>(seed);
  const P* xp = reinterpret_cast<const P*>(x);
  const P* rp = reinterpret_cast<const P*>(res);
  P* op = reinterpret_cast<P*>(out);
  for (int64_t q = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; q < packs;
       q += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c0 = (q * N) % cols;
    acc_t m[N];
    if constexpr (Active) pack_multipliers<acc_t, N>(seed, threshold, acc_t(scale), uint64_t(q) * N, m);
    P v = xp[q], r = rp[q], o;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      acc_t z = acc_t(v.v[j]) + bias[c0 + j];
      if constexpr (Active) z *= m[j];
      o.v[j] = T(z + acc_t(r.v[j]));
    }
    op[q] = o;
  }
}

// kDbias: also sum each chunk's dbias into db_part (null otherwise).
template <typename T, int N, bool Active, bool kDbias>
__global__ void backward_kernel(const T* __restrict__ dy, T* __restrict__ dx,
                                at::opmath_type<T>* __restrict__ db_part, int64_t rows,
                                int64_t cols, const int64_t* __restrict__ seed_in,
                                uint64_t threshold, double scale) {
  using acc_t = at::opmath_type<T>;
  using P = Pack<T, N>;
  const int64_t c0 = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * N;
  if (c0 >= cols) return;
  const int64_t chunk = (rows + gridDim.y - 1) / gridDim.y;
  const int64_t r0 = blockIdx.y * chunk, r1 = min(rows, r0 + chunk);
  // Read on the device: the backward never waits for a copy of the seed to the host.
  const uint64_t seed = static_cast<uint64_t>(*seed_in);
  acc_t s[N];
#pragma unroll
  for (int j = 0; j < N; ++j) s[j] = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t off = r * cols + c0;
    acc_t m[N];
    if constexpr (Active) pack_multipliers<acc_t, N>(seed, threshold, acc_t(scale), uint64_t(off), m);
    P d = *reinterpret_cast<const P*>(dy + off), o;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      acc_t g = acc_t(d.v[j]);
      if constexpr (Active) g *= m[j];
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

std::tuple<Tensor, Tensor> bias_dropout_add_fwd_cuda(const Tensor& input, const Tensor& bias,
                                                     const Tensor& residual, double p,
                                                     bool training) {
  c10::cuda::CUDAGuard guard(input.device());
  const auto [x, b, res, shape] = prepare_bias_op("bias_dropout_add", input, bias, &residual);
  const auto [rows, cols] = shape;
  check_dropout_p(p);
  const bool draw = training && p > 0.0;
  // Outside a graph the key comes from torch's default (CPU) generator, as on the CPU, so both
  // devices draw the same mask from the same seed. While a graph is captured it must come from
  // the device at replay time: the CUDA generator's graph-safe Philox state, advanced by every
  // replay (4 is the smallest increment it hands out).
  const bool capturing =
      c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  const DropoutRule rule = DropoutRule::make(p, training, draw && !capturing ? draw_dropout_seed() : 0);
  at::PhiloxCudaState philox(rule.seed, 0);
  if (draw && capturing) {
    auto gen = at::cuda::detail::getDefaultCUDAGenerator(x.device().index());
    std::lock_guard<std::mutex> lock(gen.mutex());
    philox = at::check_generator<at::CUDAGeneratorImpl>(gen)->philox_cuda_state(4);
  }
  Tensor out = at::empty_like(x);
  Tensor seed = at::empty({1}, x.options().dtype(at::kLong));
  if (x.numel() == 0) {
    seed.fill_(static_cast<int64_t>(rule.seed));
    return {out, seed};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_dropout_add", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int n = pack_width<scalar_t>(cols, {x.const_data_ptr(), res.const_data_ptr(),
                                             out.const_data_ptr()});
    with_pack<scalar_t>(n, [&](auto pack) {
      constexpr int N = decltype(pack)::value;
      with_flag(rule.active, [&](auto active) {
        const int64_t packs = x.numel() / N;
        const int threads = 256;
        forward_kernel<scalar_t, N, decltype(active)::value>
            <<<elementwise_blocks(packs, threads), threads, 0, at::cuda::getCurrentCUDAStream()>>>(
                x.const_data_ptr<scalar_t>(), b.const_data_ptr<acc_t>(),
                res.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), packs, cols,
                philox, rule.threshold, rule.scale, seed.mutable_data_ptr<int64_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  return {out, seed};
}

std::tuple<Tensor, Tensor> bias_dropout_add_bwd_cuda(const Tensor& grad_out, const Tensor& seed,
                                                     double p, bool training, bool bias_grad) {
  check_dropout_p(p);
  TORCH_CHECK(seed.numel() == 1 && seed.scalar_type() == at::kLong &&
                  seed.device() == grad_out.device(),
              "torchpar.bias_dropout_add backward: seed must be one int64 on ", grad_out.device(),
              ", got ", seed.sizes(), " ", seed.scalar_type(), " on ", seed.device());
  c10::cuda::CUDAGuard guard(grad_out.device());
  const Tensor dy = grad_out.contiguous();
  const auto [rows, cols] = rows_cols(dy, dy.size(-1));
  const DropoutRule rule = DropoutRule::make(p, training, 0);  // the key is read on the device
  const auto acc = at::toOpMathType(dy.scalar_type());
  Tensor dx = at::empty_like(dy);
  Tensor db = at::empty({bias_grad ? cols : 0}, dy.options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dy.scalar_type(), "bias_dropout_add_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int n = pack_width<scalar_t>(cols, {dy.const_data_ptr(), dx.const_data_ptr()});
    with_pack<scalar_t>(n, [&](auto pack) {
      constexpr int N = decltype(pack)::value;
      const int threads = 128;
      const dim3 grid = column_tile_grid(rows, cols, threads * N);
      Tensor part = column_partials(bias_grad ? int64_t(grid.y) : 0, cols, dy.numel() > 0,
                                    dy.options().dtype(acc));
      if (dy.numel() > 0) {
        with_flag(rule.active, [&](auto active) {
          with_flag(bias_grad, [&](auto sum) {
            backward_kernel<scalar_t, N, decltype(active)::value, decltype(sum)::value>
                <<<grid, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
                    dy.const_data_ptr<scalar_t>(), dx.mutable_data_ptr<scalar_t>(),
                    bias_grad ? part.mutable_data_ptr<acc_t>() : nullptr, rows, cols,
                    seed.const_data_ptr<int64_t>(), rule.threshold, rule.scale);
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
  m.impl("bias_dropout_add_fwd", &bias_dropout_add_fwd_cuda);
  m.impl("bias_dropout_add_bwd", &bias_dropout_add_bwd_cuda);
}

}  // namespace torchpar::kernels::cuda
