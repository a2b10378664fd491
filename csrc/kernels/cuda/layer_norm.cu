// LayerNorm on CUDA. Forward: one block per row; each thread runs Welford over its packs,
// the block merges them (warp shuffles, then shared memory), and a second pass, served
// from L1/L2, writes y. Backward: the same layout for dx (two block sums), and a
// column-tile kernel for dweight/dbias whose per-chunk partials a last kernel sums.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include "kernels/cuda/common.cuh"
#include "kernels/ops.h"

namespace torchpar::kernels::cuda {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

int row_threads(int64_t cols, int pack) {
  const int64_t packs = (cols + pack - 1) / pack;
  return packs >= 1024 ? 512 : packs >= 256 ? 256 : 128;
}

template <typename T, int N>
__global__ void forward_kernel(const T* __restrict__ x, const at::opmath_type<T>* __restrict__ w,
                               const at::opmath_type<T>* __restrict__ b, T* __restrict__ y,
                               at::opmath_type<T>* __restrict__ mean,
                               at::opmath_type<T>* __restrict__ rstd, int64_t cols, double eps) {
  using acc_t = at::opmath_type<T>;
  using P = Pack<T, N>;
  __shared__ acc_t smem[3 * 32];
  const int64_t row = blockIdx.x;
  const P* xr = reinterpret_cast<const P*>(x + row * cols);
  P* yr = reinterpret_cast<P*>(y + row * cols);
  const int64_t packs = cols / N;

  Welford<acc_t> s;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    P v = xr[p];
#pragma unroll
    for (int j = 0; j < N; ++j) s.push(acc_t(v.v[j]));
  }
  s = block_welford(s, smem);
  const acc_t mu = s.mean;
  const acc_t rs = acc_t(1) / sqrt(max(s.var(), acc_t(0)) + acc_t(eps));
  if (threadIdx.x == 0) {
    mean[row] = mu;
    rstd[row] = rs;
  }
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    P v = xr[p], o;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int64_t c = p * N + j;
      o.v[j] = T((acc_t(v.v[j]) - mu) * rs * w[c] + b[c]);
    }
    yr[p] = o;
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w.
template <typename T, int N>
__global__ void dx_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                          const at::opmath_type<T>* __restrict__ mean,
                          const at::opmath_type<T>* __restrict__ rstd,
                          const at::opmath_type<T>* __restrict__ w, T* __restrict__ dx,
                          int64_t cols) {
  using acc_t = at::opmath_type<T>;
  using P = Pack<T, N>;
  __shared__ acc_t smem[32];
  const int64_t row = blockIdx.x;
  const P* dyr = reinterpret_cast<const P*>(dy + row * cols);
  const P* xr = reinterpret_cast<const P*>(x + row * cols);
  P* dxr = reinterpret_cast<P*>(dx + row * cols);
  const int64_t packs = cols / N;
  const acc_t mu = mean[row], rs = rstd[row];

  acc_t sg = 0, sgx = 0;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    P d = dyr[p], v = xr[p];
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const acc_t g = acc_t(d.v[j]) * w[p * N + j];
      sg += g;
      sgx += g * (acc_t(v.v[j]) - mu) * rs;
    }
  }
  sg = block_sum(sg, smem);
  sgx = block_sum(sgx, smem);
  const acc_t c1 = sg / acc_t(cols), c2 = sgx / acc_t(cols);
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    P d = dyr[p], v = xr[p], o;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const acc_t g = acc_t(d.v[j]) * w[p * N + j];
      const acc_t h = (acc_t(v.v[j]) - mu) * rs;
      o.v[j] = T(rs * (g - c1 - h * c2));
    }
    dxr[p] = o;
  }
}

// Partial dweight (sum dy * xhat) and dbias (sum dy) of one chunk of rows, per column.
// Threads of a warp take adjacent columns, so every row is read coalesced.
template <typename T>
__global__ void dwdb_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                            const at::opmath_type<T>* __restrict__ mean,
                            const at::opmath_type<T>* __restrict__ rstd, int64_t rows,
                            int64_t cols, at::opmath_type<T>* __restrict__ dw_part,
                            at::opmath_type<T>* __restrict__ db_part) {
  using acc_t = at::opmath_type<T>;
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t chunk = (rows + gridDim.y - 1) / gridDim.y;
  const int64_t r0 = blockIdx.y * chunk, r1 = min(rows, r0 + chunk);
  if (c >= cols) return;
  acc_t sw = 0, sb = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const acc_t d = acc_t(dy[r * cols + c]);
    sw += d * (acc_t(x[r * cols + c]) - mean[r]) * rstd[r];
    sb += d;
  }
  dw_part[blockIdx.y * cols + c] = sw;
  db_part[blockIdx.y * cols + c] = sb;
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_fwd_cuda(const Tensor& input, c10::IntArrayRef shape,
                                                       const OptTensor& weight,
                                                       const OptTensor& bias, double eps) {
  check_layer_norm(input, c10::fromIntArrayRefSlow(shape), weight, bias);
  c10::cuda::CUDAGuard guard(input.device());
  const Tensor x = input.contiguous();
  const auto [rows, cols] = rows_cols(x, c10::multiply_integers(shape));
  Tensor w = param_as_acc(weight, cols, x, 1.0), b = param_as_acc(bias, cols, x, 0.0);
  auto [y, mean, rstd] = layer_norm_outputs(x, static_cast<int64_t>(shape.size()));
  if (x.numel() == 0) return {y, mean, rstd};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "layer_norm_fwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int n = pack_width<scalar_t>(cols, {x.const_data_ptr(), y.const_data_ptr()});
    with_pack<scalar_t>(n, [&](auto pack) {
      constexpr int N = decltype(pack)::value;
      forward_kernel<scalar_t, N><<<unsigned(rows), row_threads(cols, N), 0,
                                    at::cuda::getCurrentCUDAStream()>>>(
          x.const_data_ptr<scalar_t>(), w.const_data_ptr<acc_t>(), b.const_data_ptr<acc_t>(),
          y.mutable_data_ptr<scalar_t>(), mean.mutable_data_ptr<acc_t>(),
          rstd.mutable_data_ptr<acc_t>(), cols, eps);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {y, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_bwd_cuda(const Tensor& grad_out, const Tensor& input,
                                                       c10::IntArrayRef shape, const Tensor& mean_in,
                                                       const Tensor& rstd_in,
                                                       const OptTensor& weight,
                                                       const OptTensor& bias,
                                                       std::array<bool, 3> output_mask) {
  check_layer_norm(input, c10::fromIntArrayRefSlow(shape), weight, bias);
  c10::cuda::CUDAGuard guard(input.device());
  const Tensor x = input.contiguous();
  const Tensor dy = prepare_grad("layer_norm", grad_out, x);
  const Tensor mean = mean_in.contiguous(), rstd = rstd_in.contiguous();
  const auto [rows, cols] = rows_cols(x, c10::multiply_integers(shape));
  const auto acc = at::toOpMathType(x.scalar_type());
  const LayerNormGrads want(output_mask, weight, bias);
  Tensor w = param_as_acc(weight, cols, x, 1.0);
  Tensor dx = want.dx ? at::empty_like(x) : at::empty({0}, x.options());
  Tensor dw = want.dweight ? at::empty(weight->sizes(), weight->options()) : at::empty({0}, x.options());
  Tensor db = want.dbias ? at::empty(bias->sizes(), bias->options()) : at::empty({0}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "layer_norm_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    auto stream = at::cuda::getCurrentCUDAStream();
    if (want.dx && x.numel() > 0) {
      const int n = pack_width<scalar_t>(cols, {x.const_data_ptr(), dy.const_data_ptr(),
                                               dx.const_data_ptr()});
      with_pack<scalar_t>(n, [&](auto pack) {
        constexpr int N = decltype(pack)::value;
        dx_kernel<scalar_t, N><<<unsigned(rows), row_threads(cols, N), 0, stream>>>(
            dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
            mean.const_data_ptr<acc_t>(), rstd.const_data_ptr<acc_t>(), w.const_data_ptr<acc_t>(),
            dx.mutable_data_ptr<scalar_t>(), cols);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
    if (!want.params()) return;
    const int threads = 128;
    const dim3 grid = column_tile_grid(rows, cols, threads);
    Tensor dw_part = column_partials(grid.y, cols, x.numel() > 0, x.options().dtype(acc));
    Tensor db_part = column_partials(grid.y, cols, x.numel() > 0, x.options().dtype(acc));
    if (x.numel() > 0) {
      dwdb_kernel<scalar_t><<<grid, threads, 0, stream>>>(
          dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), mean.const_data_ptr<acc_t>(),
          rstd.const_data_ptr<acc_t>(), rows, cols, dw_part.mutable_data_ptr<acc_t>(),
          db_part.mutable_data_ptr<acc_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (want.dweight) sum_partials<scalar_t, acc_t>(dw_part, dw);
    if (want.dbias) sum_partials<scalar_t, acc_t>(db_part, db);
  });
  return {dx, dw, db};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchpar, CUDA, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_cuda);
  m.impl("layer_norm_bwd", &layer_norm_bwd_cuda);
}

}  // namespace torchpar::kernels::cuda
