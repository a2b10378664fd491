// LayerNorm on CPU (Ba, Kiros & Hinton, arXiv:1607.06450), one row per step of
// at::parallel_for. Forward: one Welford pass for the statistics, one pass to normalise;
// the row is back in L1/L2 for the second pass, so memory sees x once and y once.
// Backward: the same two passes over (dy, x), with dweight/dbias summed per thread.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/accumulate.h>

#include <cmath>

#include "kernels/cpu/kernels.h"
#include "kernels/cpu/vec.h"
#include "kernels/ops.h"
#include "kernels/welford.h"

namespace torchpar::kernels::cpu::CPU_CAPABILITY {
namespace {

using at::Tensor;

template <typename T, typename acc_t, typename Vec>
acc_t reduce_sum(const Vec& v) {
  return at::vec::vec_reduce_all<acc_t>([](Vec a, Vec b) { return a + b; }, v);
}

// One chunk's exact statistics, lane by lane: the mean of each lane's k elements and their
// M2 about it (q0 + q1: the two vectors of each step). From L1 in two passes, or with the
// chunk read once into registers where it fits in them (the float vectors of a 256-element
// chunk on AVX-512): 16-bit input is then converted to float once instead of twice, 5 % off
// the whole bfloat16/float16 forward in cache (A/B alternating in one process; float32 level).
template <typename T>
struct ChunkStats {
  using Vec = typename VecIO<T>::Vec;
  Vec mean, q0, q1;

  template <int64_t kVecs>
  static ChunkStats in_registers(const T* xc) {
    using IO = VecIO<T>;
    constexpr int64_t V = Vec::size();
    Vec v[kVecs];
    for (int64_t j = 0; j < kVecs; j += 2) IO::load2(xc + j * V, v[j], v[j + 1]);
    Vec s0 = v[0], s1 = v[1];
    for (int64_t j = 2; j < kVecs; j += 2) {
      s0 = s0 + v[j];
      s1 = s1 + v[j + 1];
    }
    ChunkStats c{(s0 + s1) * Vec(1 / at::opmath_type<T>(kVecs)), Vec(0), Vec(0)};
    for (int64_t j = 0; j < kVecs; j += 2) {
      const Vec a = v[j] - c.mean, b = v[j + 1] - c.mean;
      c.q0 = at::vec::fmadd(a, a, c.q0);
      c.q1 = at::vec::fmadd(b, b, c.q1);
    }
    return c;
  }

  static ChunkStats from_l1(const T* xc, int64_t len) {
    using IO = VecIO<T>;
    Vec s0(0), s1(0);
    for (int64_t i = 0; i < len; i += IO::kStep) {
      Vec a, b;
      IO::load2(xc + i, a, b);
      s0 = s0 + a;
      s1 = s1 + b;
    }
    ChunkStats c{(s0 + s1) * Vec(1 / at::opmath_type<T>(len / Vec::size())), Vec(0), Vec(0)};
    for (int64_t i = 0; i < len; i += IO::kStep) {
      Vec a, b;
      IO::load2(xc + i, a, b);
      a = a - c.mean;
      b = b - c.mean;
      c.q0 = at::vec::fmadd(a, a, c.q0);
      c.q1 = at::vec::fmadd(b, b, c.q1);
    }
    return c;
  }
};

// Mean and population variance of one row, in acc_t: Welford's update applied per chunk
// (Chan, Golub & LeVeque's merge of exact chunk statistics), lane by lane. A chunk is 256
// elements, in L1 (or registers) after its first read, so each lane's exact chunk mean and M2
// are cheap (ChunkStats); the lanes keep their own running statistics, merged with vector
// operations, and meet once per row. Merging per element instead puts a dependent
// divide-and-FMA chain on every vector, and reducing across lanes per chunk put two horizontal
// sums and a divide on each chunk's critical path (in cache: 0.12-0.14 ns per element per
// core, 0.10-0.12 now).
template <typename T>
Welford<at::opmath_type<T>> row_stats(const T* x, int64_t cols) {
  using IO = VecIO<T>;
  using acc_t = typename IO::acc_t;
  using Vec = typename IO::Vec;
  constexpr int64_t kChunk = 256;  // a multiple of IO::kStep
  constexpr int64_t V = Vec::size();
  constexpr int64_t kChunkVecs = kChunk / V;
  constexpr bool kInRegisters = kChunkVecs <= 16;  // AVX-512's 32 registers hold it and more
  const int64_t full = cols / IO::kStep * IO::kStep;
  Vec mean(0), m2(0);  // per lane; lane j covers the elements at j and j + V of every step
  acc_t n = 0;         // elements per lane so far
  for (int64_t c0 = 0; c0 < full; c0 += kChunk) {
    const int64_t len = std::min(kChunk, full - c0);
    const ChunkStats<T> c = [&] {
      if constexpr (kInRegisters) {
        if (len == kChunk) return ChunkStats<T>::template in_registers<kChunkVecs>(x + c0);
      }
      return ChunkStats<T>::from_l1(x + c0, len);
    }();
    const acc_t k = acc_t(len / V), total = n + k, w = k / total;
    const Vec d = c.mean - mean;
    mean = at::vec::fmadd(d, Vec(w), mean);
    m2 = m2 + (c.q0 + c.q1) + d * d * Vec(n * w);
    n = total;
  }
  Welford<acc_t> s;
  if (n > 0) {
    // Every lane holds n elements: the row's mean is the lanes' mean, and M2 adds each lane's
    // spread about it.
    const acc_t mu = reduce_sum<T, acc_t>(mean) / acc_t(V);
    const Vec dm = mean - Vec(mu);
    s = Welford<acc_t>(mu, reduce_sum<T, acc_t>(at::vec::fmadd(dm * dm, Vec(n), m2)), n * acc_t(V));
  }
  if (full < cols) {  // the last cols - full elements, exactly
    const int64_t t = cols - full;
    acc_t sum = 0;
    for (int64_t j = full; j < cols; ++j) sum += acc_t(x[j]);
    const acc_t tmean = sum / acc_t(t);
    acc_t tm2 = 0;
    for (int64_t j = full; j < cols; ++j) tm2 += (acc_t(x[j]) - tmean) * (acc_t(x[j]) - tmean);
    s.merge(Welford<acc_t>(tmean, tm2, acc_t(t)));
  }
  return s;
}

// P, the weight's and bias's element type: the accumulate type, or T itself for wide rows
// (kWideRow). stream: write y with non-temporal stores (stream_output).
template <typename T, typename P>
void forward(const T* x, const P* w, const P* b, T* y,
             at::opmath_type<T>* mean, at::opmath_type<T>* rstd, int64_t rows, int64_t cols,
             double eps, bool stream) {
  using IO = VecIO<T>;
  using acc_t = typename IO::acc_t;
  using Vec = typename IO::Vec;
  at::parallel_for(0, rows, row_grain(cols), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * cols;
      T* yr = y + r * cols;
      auto s = row_stats(xr, cols);
      acc_t mu = s.mean;
      acc_t rs = acc_t(1) / std::sqrt(std::max(s.var(), acc_t(0)) + acc_t(eps));
      mean[r] = mu;
      rstd[r] = rs;
      // y = (x - mu) * rs * w + b = x * (rs * w) + (b - mu * rs * w)
      const Vec vmu(mu), vrs(rs);
      // This pass reads the row from L1 and asks nothing of memory, so the hardware
      // prefetcher, which follows demand misses, idles until the next row's statistics miss.
      // Asking for the next row here overlaps its read with this row's writes: from DRAM,
      // 1.00-1.12x with plain or streaming stores, once 1.30x (A/B in one process,
      // alternating); two rows ahead was slower than one.
      const T* next = r + 1 < r1 ? xr + cols : nullptr;
      int64_t i = 0;
      for (; i + IO::kStep <= cols; i += IO::kStep) {
        Vec a, c, w0, w1, b0, b1;
        if (next) prefetch(next + i, IO::kStep);
        IO::load2(xr + i, a, c);
        VecIO<P>::load2(w + i, w0, w1);
        VecIO<P>::load2(b + i, b0, b1);
        a = at::vec::fmadd((a - vmu) * vrs, w0, b0);
        c = at::vec::fmadd((c - vmu) * vrs, w1, b1);
        IO::store2(yr + i, a, c, stream);
      }
      for (; i < cols; ++i) yr[i] = T((acc_t(xr[i]) - mu) * rs * acc_t(w[i]) + acc_t(b[i]));
    }
    stream_fence(stream);
  });
}

// The two vectors at column i of one row: dy, g = dy * w and xhat = (x - mean) * rstd.
template <typename T, typename Vec>
struct BackwardStep {
  Vec d0, d1, g0, g1, h0, h1;
  BackwardStep(const T* dy, const T* x, const at::opmath_type<T>* w, int64_t i, const Vec& vmu,
               const Vec& vrs) {
    Vec x0, x1;
    VecIO<T>::load2(dy + i, d0, d1);
    VecIO<T>::load2(x + i, x0, x1);
    h0 = (x0 - vmu) * vrs;
    h1 = (x1 - vmu) * vrs;
    g0 = d0 * Vec::loadu(w + i);
    g1 = d1 * Vec::loadu(w + i + Vec::size());
  }
};

// Pass 1 of the backward over n columns of one row: adds sum(g) and sum(g * xhat) to sums, and
// (kParamGrads) the row's share to the dweight and dbias partials (g = dy * w,
// xhat = (x - mean) * rstd).
template <typename T, bool kParamGrads>
void backward_sums(const T* dy, const T* x, const at::opmath_type<T>* w, at::opmath_type<T>* dwp,
                   at::opmath_type<T>* dbp, at::opmath_type<T> mu, at::opmath_type<T> rs,
                   int64_t n, at::opmath_type<T>& sum_g, at::opmath_type<T>& sum_gx) {
  using IO = VecIO<T>;
  using acc_t = typename IO::acc_t;
  using Vec = typename IO::Vec;
  constexpr int64_t V = Vec::size();
  const Vec vmu(mu), vrs(rs);
  Vec sg(0), sgx(0);
  int64_t i = 0;
  for (; i + IO::kStep <= n; i += IO::kStep) {
    const BackwardStep<T, Vec> s(dy, x, w, i, vmu, vrs);
    sg = sg + s.g0 + s.g1;
    sgx = at::vec::fmadd(s.g0, s.h0, at::vec::fmadd(s.g1, s.h1, sgx));
    if constexpr (kParamGrads) {
      at::vec::fmadd(s.d0, s.h0, Vec::loadu(dwp + i)).store(dwp + i);
      at::vec::fmadd(s.d1, s.h1, Vec::loadu(dwp + i + V)).store(dwp + i + V);
      (Vec::loadu(dbp + i) + s.d0).store(dbp + i);
      (Vec::loadu(dbp + i + V) + s.d1).store(dbp + i + V);
    }
  }
  acc_t g_total = reduce_sum<T, acc_t>(sg), gx_total = reduce_sum<T, acc_t>(sgx);
  for (; i < n; ++i) {
    acc_t d = acc_t(dy[i]), h = (acc_t(x[i]) - mu) * rs, g = d * w[i];
    g_total += g;
    gx_total += g * h;
    if constexpr (kParamGrads) {
      dwp[i] += d * h;
      dbp[i] += d;
    }
  }
  sum_g += g_total;
  sum_gx += gx_total;
}

// Pass 2 over n columns of one row: dx = rstd * (g - c1 - xhat * c2), c1 = mean(g) and
// c2 = mean(g * xhat) over the whole row. next (elements, 0: none): where the row that pass 1
// reads next lies, brought into cache while this pass works from L1 and L2 (as the forward
// does). Tiles of wide rows ask for it: their pass 2 runs over 8 rows without a miss, and the
// prefetch made the backward 1.02-1.55x faster from DRAM at 2048x4096 (A/B alternating in one
// process); a lone row of up to 1024 columns does not, where it came out 0.94-1.00x.
template <typename T>
void backward_dx(const T* dy, const T* x, const at::opmath_type<T>* w, T* dx,
                 at::opmath_type<T> mu, at::opmath_type<T> rs, at::opmath_type<T> c1,
                 at::opmath_type<T> c2, int64_t n, bool stream, int64_t next) {
  using IO = VecIO<T>;
  using acc_t = typename IO::acc_t;
  using Vec = typename IO::Vec;
  const Vec vmu(mu), vrs(rs), vc1(c1), vc2(c2);
  int64_t i = 0;
  for (; i + IO::kStep <= n; i += IO::kStep) {
    if (next != 0) {
      prefetch(dy + next + i, IO::kStep);
      prefetch(x + next + i, IO::kStep);
    }
    const BackwardStep<T, Vec> s(dy, x, w, i, vmu, vrs);
    IO::store2(dx + i, vrs * (s.g0 - vc1 - s.h0 * vc2), vrs * (s.g1 - vc1 - s.h1 * vc2), stream);
  }
  for (; i < n; ++i) {
    acc_t h = (acc_t(x[i]) - mu) * rs, g = acc_t(dy[i]) * w[i];
    dx[i] = T(rs * (g - c1 - h * c2));
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w, xhat = (x - mean) * rstd.
//
// A row up to kBwdChunk columns wide goes alone: pass 1 (the two row sums, and the row's share
// of dweight and dbias), then pass 2 (dx) while the row is still in L1. Wider rows overflow L1
// with pass 1's five streams (at 4096 float32 columns the backward cost 25% more per element),
// so they go in tiles of kBwdTileRows rows, kBwdChunk columns at a time and row by row within a
// chunk: the chunk's slices of w and of the dweight/dbias partials stay in L1 across the tile,
// and the tile's rows wait in L2 for pass 2.
constexpr int64_t kBwdChunk = 1024, kBwdTileRows = 8;

// kParamGrads: sum dweight and dbias into dw and db (unused otherwise). dx null: no dx (pass 1
// then serves the parameter gradients alone). stream: write dx with non-temporal stores.
template <typename T, bool kParamGrads>
void backward(const T* dy, const T* x, const at::opmath_type<T>* mean,
              const at::opmath_type<T>* rstd, const at::opmath_type<T>* w, T* dx,
              ColumnPartials<at::opmath_type<T>>& dw, ColumnPartials<at::opmath_type<T>>& db,
              int64_t rows, int64_t cols, bool stream) {
  using acc_t = at::opmath_type<T>;
  const int64_t tile_rows = cols <= kBwdChunk ? 1 : kBwdTileRows;
  at::parallel_for(0, rows, row_grain(cols), [&](int64_t r0, int64_t r1) {
    acc_t* dwp = kParamGrads ? dw.row(at::get_thread_num()) : nullptr;
    acc_t* dbp = kParamGrads ? db.row(at::get_thread_num()) : nullptr;
    for (int64_t rb = r0; rb < r1; rb += tile_rows) {
      const int64_t re = std::min(rb + tile_rows, r1);
      acc_t sum_g[kBwdTileRows] = {}, sum_gx[kBwdTileRows] = {};
      for (int64_t c0 = 0; c0 < cols; c0 += kBwdChunk) {
        const int64_t n = std::min(kBwdChunk, cols - c0);
        for (int64_t r = rb; r < re; ++r) {
          const int64_t o = r * cols + c0;
          backward_sums<T, kParamGrads>(dy + o, x + o, w + c0, kParamGrads ? dwp + c0 : nullptr,
                                        kParamGrads ? dbp + c0 : nullptr, mean[r], rstd[r], n,
                                        sum_g[r - rb], sum_gx[r - rb]);
        }
      }
      if (dx == nullptr) continue;
      for (int64_t c0 = 0; c0 < cols; c0 += kBwdChunk) {
        const int64_t n = std::min(kBwdChunk, cols - c0);
        for (int64_t r = rb; r < re; ++r) {
          const int64_t o = r * cols + c0;
          backward_dx<T>(dy + o, x + o, w + c0, dx + o, mean[r], rstd[r],
                         sum_g[r - rb] / acc_t(cols), sum_gx[r - rb] / acc_t(cols), n, stream,
                         tile_rows > 1 && r + tile_rows < r1 ? tile_rows * cols : 0);
        }
      }
    }
    stream_fence(stream);
  });
}

}  // namespace


std::tuple<Tensor, Tensor, Tensor> layer_norm_fwd(const Tensor& input, c10::IntArrayRef shape,
                                                      const OptTensor& weight,
                                                      const OptTensor& bias, double eps) {
  check_layer_norm(input, c10::fromIntArrayRefSlow(shape), weight, bias);
  const Tensor x = input.contiguous();
  const auto [rows, cols] = rows_cols(x, c10::multiply_integers(shape));
  Tensor w = param_as_acc(weight, cols, x, 1.0), b = param_as_acc(bias, cols, x, 0.0);
  auto [y, mean, rstd] = layer_norm_outputs(x, static_cast<int64_t>(shape.size()));
  if (x.numel() == 0) return {y, mean, rstd};
  const bool stream = stream_output(y);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "layer_norm_fwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto* xp = x.const_data_ptr<scalar_t>();
    auto* yp = y.mutable_data_ptr<scalar_t>();
    auto* mp = mean.mutable_data_ptr<acc_t>();
    auto* rp = rstd.mutable_data_ptr<acc_t>();
    // bfloat16 2048x4096 from DRAM: 0.87-0.90 -> 0.62-0.63 ms with 16-bit parameters, level
    // with 8192x1024.
    if (!std::is_same_v<scalar_t, acc_t> &&
        params_as_16bit(x, cols, {weight ? &*weight : nullptr, bias ? &*bias : nullptr})) {
      const Tensor w16 = w.to(x.scalar_type()), b16 = b.to(x.scalar_type());
      forward<scalar_t>(xp, w16.const_data_ptr<scalar_t>(), b16.const_data_ptr<scalar_t>(), yp,
                        mp, rp, rows, cols, eps, stream);
    } else {
      forward<scalar_t>(xp, w.const_data_ptr<acc_t>(), b.const_data_ptr<acc_t>(), yp, mp, rp,
                        rows, cols, eps, stream);
    }
  });
  return {y, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_bwd(const Tensor& grad_out, const Tensor& input,
                                                      c10::IntArrayRef shape, const Tensor& mean,
                                                      const Tensor& rstd, const OptTensor& weight,
                                                      const OptTensor& bias, Mask3 output_mask) {
  check_layer_norm(input, c10::fromIntArrayRefSlow(shape), weight, bias);
  const Tensor x = input.contiguous();
  const Tensor dy = prepare_grad("layer_norm", grad_out, x);
  const auto [rows, cols] = rows_cols(x, c10::multiply_integers(shape));
  const auto acc = at::toOpMathType(x.scalar_type());
  const LayerNormGrads want(output_mask, weight, bias);
  Tensor w = param_as_acc(weight, cols, x, 1.0);
  Tensor dx = want.dx ? at::empty_like(x) : at::empty({0}, x.options());
  Tensor dw_out = at::empty({0}, x.options()), db_out = at::empty({0}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "layer_norm_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int64_t partial_rows = want.params() ? at::get_num_threads() : 0;
    ColumnPartials<acc_t> dw(partial_rows, cols, acc), db(partial_rows, cols, acc);
    if (x.numel() > 0 && (want.dx || want.params())) {
      with_flag(want.params(), [&](auto params) {
        backward<scalar_t, decltype(params)::value>(
            dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
            mean.contiguous().const_data_ptr<acc_t>(), rstd.contiguous().const_data_ptr<acc_t>(),
            w.const_data_ptr<acc_t>(), want.dx ? dx.mutable_data_ptr<scalar_t>() : nullptr, dw,
            db, rows, cols, stream_output(dx));
      });
    }
    if (want.dweight) dw_out = dw.sum(weight->scalar_type()).view(weight->sizes());
    if (want.dbias) db_out = db.sum(bias->scalar_type()).view(bias->sizes());
  });
  return {dx, dw_out, db_out};
}

}  // namespace torchpar::kernels::cpu::CPU_CAPABILITY
