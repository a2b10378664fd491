// Building blocks of the CUDA kernels: packed (vectorised) loads, warp and block
// reductions, and the per-column partial sums that dbias and dweight need.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>

#include <cstdint>
#include <type_traits>

#include "kernels/welford.h"

namespace torchpar::kernels::cuda {

constexpr int kWarp = 32;

// N elements moved by one 16-byte (or narrower) load: the widest access a thread can
// issue, which is what lets a memory-bound kernel reach the DRAM roofline.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T>
constexpr int kPackMax = 16 / sizeof(T);

// Pack width usable for rows of `cols` elements starting at every pointer in `ptrs`.
template <typename T>
inline int pack_width(int64_t cols, std::initializer_list<const void*> ptrs) {
  int n = kPackMax<T>;
  for (const void* p : ptrs) {
    while (n > 1 && (reinterpret_cast<uintptr_t>(p) % (sizeof(T) * n) != 0)) n /= 2;
  }
  while (n > 1 && cols % n != 0) n /= 2;
  return n;
}

// Calls f(std::integral_constant<int, N>) for the pack width chosen at run time.
template <typename T, typename F>
inline void with_pack(int n, F&& f) {
  switch (n) {
    case 8: if constexpr (kPackMax<T> >= 8) { f(std::integral_constant<int, 8>{}); return; } break;
    case 4: if constexpr (kPackMax<T> >= 4) { f(std::integral_constant<int, 4>{}); return; } break;
    case 2: f(std::integral_constant<int, 2>{}); return;
    default: break;
  }
  f(std::integral_constant<int, 1>{});
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block; every thread gets the result. `smem` holds one T per warp.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* smem) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int warps = (blockDim.x + kWarp - 1) / kWarp;
  v = warp_sum(v);
  __syncthreads();  // smem may still be read by a previous call
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < warps ? smem[lane] : T(0);
  return warp_sum(v);
}

template <typename T>
__device__ __forceinline__ Welford<T> warp_welford(Welford<T> w) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) {
    Welford<T> other(__shfl_xor_sync(0xffffffffu, w.mean, o), __shfl_xor_sync(0xffffffffu, w.m2, o),
                     __shfl_xor_sync(0xffffffffu, w.n, o));
    w.merge(other);
  }
  return w;
}

// Welford over the block; every thread gets the result. `smem` holds 3 T per warp.
template <typename T>
__device__ __forceinline__ Welford<T> block_welford(Welford<T> w, T* smem) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int warps = (blockDim.x + kWarp - 1) / kWarp;
  w = warp_welford(w);
  __syncthreads();
  if (lane == 0) {
    smem[3 * warp] = w.mean;
    smem[3 * warp + 1] = w.m2;
    smem[3 * warp + 2] = w.n;
  }
  __syncthreads();
  Welford<T> v;
  if (lane < warps) v = Welford<T>(smem[3 * lane], smem[3 * lane + 1], smem[3 * lane + 2]);
  return warp_welford(v);
}

// Column sums in two steps: kernels that stream rows keep one partial row per block row
// (`partial`, [blocks_y, cols] of acc_t), and this kernel sums them into `out` of type T.
// sum_partials<T, acc_t> writes `out` as T, or as acc_t where `out` is a float32 parameter's
// gradient beside 16-bit T (kernels/ops.h).
template <typename T, typename acc_t>
__global__ void sum_partials_kernel(const acc_t* __restrict__ partial, int64_t parts, int64_t cols,
                                    T* __restrict__ out) {
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < cols;
       c += int64_t(gridDim.x) * blockDim.x) {
    acc_t s = 0;
    for (int64_t p = 0; p < parts; ++p) s += partial[p * cols + c];
    out[c] = T(s);
  }
}

template <typename T, typename acc_t>
inline void sum_partials(const at::Tensor& partial, at::Tensor& out) {
  const int64_t parts = partial.size(0), cols = partial.size(1);
  const int threads = 256;
  const int blocks = int(std::min<int64_t>((cols + threads - 1) / threads, 1024));
  if (cols == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  if (out.scalar_type() == partial.scalar_type()) {
    sum_partials_kernel<acc_t, acc_t><<<blocks, threads, 0, stream>>>(
        partial.const_data_ptr<acc_t>(), parts, cols, out.mutable_data_ptr<acc_t>());
  } else {
    sum_partials_kernel<T, acc_t><<<blocks, threads, 0, stream>>>(
        partial.const_data_ptr<acc_t>(), parts, cols, out.mutable_data_ptr<T>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The [parts, cols] partials of a column-tile kernel, which writes every (part, column) once,
// a chunk past the last row included (as zeros): left uninitialised, saving a memset launch per
// backward. Zeros only when the kernel will not run (no rows or no columns), so that
// sum_partials reads zeros.
inline at::Tensor column_partials(int64_t parts, int64_t cols, bool kernel_runs,
                                  const at::TensorOptions& options) {
  return kernel_runs ? at::empty({parts, cols}, options) : at::zeros({parts, cols}, options);
}

// Grid for kernels that walk a [rows, cols] matrix by column tiles (x) and row chunks (y):
// enough row chunks to fill the GPU, each at least `min_rows` long so partials stay few.
inline dim3 column_tile_grid(int64_t rows, int64_t cols, int tile_cols, int64_t min_rows = 32) {
  const int64_t tiles = (cols + tile_cols - 1) / tile_cols;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t chunks = std::max<int64_t>(1, (4 * sms + tiles - 1) / tiles);
  chunks = std::min<int64_t>(chunks, std::max<int64_t>(1, rows / min_rows));
  return dim3(unsigned(tiles), unsigned(std::min<int64_t>(chunks, 65535)));
}

inline int elementwise_blocks(int64_t work, int threads) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return int(std::max<int64_t>(1, std::min<int64_t>((work + threads - 1) / threads, 8 * sms)));
}

}  // namespace torchpar::kernels::cuda
