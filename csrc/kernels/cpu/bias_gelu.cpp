// bias + GeLU on CPU: one read of x and one write of y forward; one read of (dy, x) and one
// write of dx backward, with dbias summed per thread on the way (kernels/gelu.h has the math).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "kernels/cpu/gelu_grad_table.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/vec.h"
#include "kernels/gelu.h"
#include "kernels/ops.h"

namespace torchpar::kernels::cpu::CPU_CAPABILITY {
namespace {

using at::Tensor;

#if defined(CPU_CAPABILITY_AVX512)
// gelu'(z) for 16-bit results from the polynomials of gelu_grad_table.h: |z| picks one of 16
// segments, whose degree-5 coefficients come from one register each by a permute, and
// gelu'(-a) = 1 - gelu'(a). About 17 vector operations on a short dependency chain, against
// ~27 on a long one (exp, erfc and a reciprocal) for the formulas; absolute error 1.2e-7, where
// the formulas' 16-bit forms reach 7e-5. That is relative accuracy enough down to z = -4
// (gelu'(-4) = -5e-4); below, only the formulas keep it, so a lane there (or a NaN) takes
// them, merged into its vector lane by lane. Past |z| = 6 the last segment gives gelu' = 1, as
// float32 has it.
struct GeluGradTable {
  static constexpr bool kAvailable = true;
  __m512 c[kGeluGradDegree + 1];

  explicit GeluGradTable(GeluApprox approx) {
    const auto& coefs = approx == GeluApprox::Tanh ? kGeluGradTanh : kGeluGradErf;
    for (int j = 0; j <= kGeluGradDegree; ++j) c[j] = _mm512_load_ps(coefs[j]);
  }

  // gelu'(z), lane by lane; the lanes below -4 or NaN from formula(z.v[k]) instead.
  template <int K, typename Formula>
  Lanes<K> operator()(const Lanes<K>& z, Formula&& formula) const {
    const __m512 scale = _mm512_set1_ps(1.f / kGeluGradSegmentWidth);
    const __m512 last = _mm512_set1_ps(float(kGeluGradSegments) * (1.f - 0x1p-23f));
    Lanes<K> g;
    __mmask16 tail[K];
    for (int k = 0; k < K; ++k) {
      const __m512 zk = z.v[k];
      tail[k] = _mm512_cmp_ps_mask(zk, _mm512_set1_ps(-4.f), _CMP_NGE_UQ);
      const __mmask16 negative = _mm512_cmp_ps_mask(zk, _mm512_setzero_ps(), _CMP_LT_OQ);
      const __m512 s = _mm512_min_ps(_mm512_mul_ps(_mm512_abs_ps(zk), scale), last);
      const __m512i segment = _mm512_cvttps_epi32(s);
      const __m512 t = _mm512_reduce_ps(s, _MM_FROUND_TO_NEG_INF);  // s - floor(s)
      __m512 p = _mm512_permutexvar_ps(segment, c[kGeluGradDegree]);
      for (int j = kGeluGradDegree - 1; j >= 0; --j) {
        p = _mm512_fmadd_ps(p, t, _mm512_permutexvar_ps(segment, c[j]));
      }
      g.v[k] = _mm512_mask_sub_ps(p, negative, _mm512_set1_ps(1.f), p);
    }
    for (int k = 0; k < K; ++k) {
      if (tail[k] != 0) g.v[k] = _mm512_mask_mov_ps(g.v[k], tail[k], formula(z.v[k]));
    }
    return g;
  }
};
#else
struct GeluGradTable {  // AVX2 has no 16-entry permute: the formulas serve every lane
  static constexpr bool kAvailable = false;
  explicit GeluGradTable(GeluApprox) {}
  template <int K, typename Formula>
  Lanes<K> operator()(const Lanes<K>& z, Formula&& formula) const {
    return Lanes<K>::map(formula, z);
  }
};
#endif

// stream: write y with non-temporal stores (stream_output).
template <typename T, GeluApprox A>
void forward(const T* x, const at::opmath_type<T>* bias, T* y, int64_t rows, int64_t cols,
             bool stream) {
  using IO = VecIO<T>;
  using acc_t = typename IO::acc_t;
  using Vec = typename IO::Vec;
  using Math = VecMath<!IO::kReduced>;
  constexpr int64_t V = Vec::size();
  at::parallel_for(0, rows, row_grain(cols), [&](int64_t r0, int64_t r1) __attribute__((flatten)) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * cols;
      T* yr = y + r * cols;
      int64_t i = 0;
      if constexpr (std::is_same_v<acc_t, float>) {
        using L = Lanes<kLanes>;
        for (; i + L::size() <= cols; i += L::size()) {
          const L z = IO::template load<kLanes>(xr + i) + L::loadu(bias + i);
          IO::template store<kLanes>(yr + i, gelu<L, Math>(z, A), stream);
        }
      }
      for (; i + IO::kStep <= cols; i += IO::kStep) {
        Vec a, b;
        IO::load2(xr + i, a, b);
        a = gelu<Vec, Math>(a + Vec::loadu(bias + i), A);
        b = gelu<Vec, Math>(b + Vec::loadu(bias + i + V), A);
        IO::store2(yr + i, a, b, stream);
      }
      for (; i < cols; ++i) yr[i] = T(gelu<acc_t>(acc_t(xr[i]) + bias[i], A));
    }
    stream_fence(stream);
  });
}

// What the backward does with the gradient terms besides writing dx: nothing (the bias needs
// no gradient), or sum them into dbias, of input's dtype or float32. A float32 bias beside a
// 16-bit x (mixed precision) needs float32-accurate terms, not only those of the 16-bit dx.
enum class Dbias { kNone, kInputDtype, kFloat32 };

// kMixed: whether input's dtype admits a float32 bias (16-bit input); else no kFloat32 code.
template <bool kMixed, typename F>
void with_dbias(Dbias d, F&& f) {
  switch (d) {
    case Dbias::kNone: return f(std::integral_constant<Dbias, Dbias::kNone>{});
    case Dbias::kInputDtype: return f(std::integral_constant<Dbias, Dbias::kInputDtype>{});
    case Dbias::kFloat32:
      if constexpr (kMixed) return f(std::integral_constant<Dbias, Dbias::kFloat32>{});
  }
  TORCH_CHECK(false, "torchpar.bias_gelu: a float32 bias needs 16-bit input");  // check_bias_op's rule
}

// B, the bias's element type: the accumulate type, or T itself for wide rows (kWideRow).
// stream: write dx with non-temporal stores.
template <typename T, GeluApprox A, typename B, Dbias D>
void backward(const T* dy, const T* x, const B* bias, T* dx,
              ColumnPartials<at::opmath_type<T>>& db, int64_t rows, int64_t cols, bool stream) {
  using IO = VecIO<T>;
  using acc_t = typename IO::acc_t;
  using Vec = typename IO::Vec;
  using Math = VecMath<gelu_grad_full_precision<T> || D == Dbias::kFloat32>;
  constexpr bool kSum = D != Dbias::kNone;
  // 16-bit results (and a dbias of their dtype) take the table, 4 vectors a step, and the
  // formulas for a lane it does not cover.
  constexpr bool kTable = GeluGradTable::kAvailable && IO::kReduced && D != Dbias::kFloat32;
  constexpr int K = kTable ? 4 : kLanes;
  [[maybe_unused]] constexpr int64_t V = Vec::size();
  at::parallel_for(0, rows, row_grain(cols), [&](int64_t r0, int64_t r1) __attribute__((flatten)) {
    acc_t* dbp = kSum ? db.row(at::get_thread_num()) : nullptr;
    const GeluGradTable table(A);
    // W float vectors of one row from column i: gelu' from the table where it covers every
    // lane of a vector (kTable), else from the formulas, W vectors in lockstep.
    auto float_step = [&](auto width, const T* dyr, const T* xr, T* dxr, int64_t i) {
      constexpr int W = decltype(width)::value;
      using L = Lanes<W>;
      const L z = IO::template load<W>(xr + i) + VecIO<B>::template load<W>(bias + i);
      L grad;
      if constexpr (kTable) {
        grad = table(z, [](const Vec& zk) { return gelu_grad<Vec, Math>(zk, A); });
      } else {
        grad = gelu_grad<L, Math>(z, A);
      }
      const L g = IO::template load<W>(dyr + i) * grad;
      IO::template store<W>(dxr + i, g, stream);
      if constexpr (kSum) (L::loadu(dbp + i) + g).store(dbp + i);
    };
    for (int64_t r = r0; r < r1; ++r) {
      const T* dyr = dy + r * cols;
      const T* xr = x + r * cols;
      T* dxr = dx + r * cols;
      int64_t i = 0;
      if constexpr (std::is_same_v<acc_t, float>) {
        for (; i + Lanes<K>::size() <= cols; i += Lanes<K>::size()) {
          float_step(std::integral_constant<int, K>{}, dyr, xr, dxr, i);
        }
        for (; i + Lanes<2>::size() <= cols; i += Lanes<2>::size()) {
          float_step(std::integral_constant<int, 2>{}, dyr, xr, dxr, i);
        }
      } else {
        for (; i + IO::kStep <= cols; i += IO::kStep) {
          Vec d0, d1, x0, x1, b0, b1;
          IO::load2(dyr + i, d0, d1);
          IO::load2(xr + i, x0, x1);
          VecIO<B>::load2(bias + i, b0, b1);
          Vec g0 = d0 * gelu_grad<Vec, Math>(x0 + b0, A);
          Vec g1 = d1 * gelu_grad<Vec, Math>(x1 + b1, A);
          IO::store2(dxr + i, g0, g1, stream);
          if constexpr (kSum) {
            (Vec::loadu(dbp + i) + g0).store(dbp + i);
            (Vec::loadu(dbp + i + V) + g1).store(dbp + i + V);
          }
        }
      }
      for (; i < cols; ++i) {
        acc_t g = acc_t(dyr[i]) * gelu_grad<acc_t>(acc_t(xr[i]) + acc_t(bias[i]), A);
        dxr[i] = T(g);
        if constexpr (kSum) dbp[i] += g;
      }
    }
    stream_fence(stream);
  });
}

}  // namespace


Tensor bias_gelu(const Tensor& input, const Tensor& bias, c10::string_view approximate) {
  const GeluApprox approx = parse_gelu_approx(approximate);
  const auto [x, b, unused, shape] = prepare_bias_op("bias_gelu", input, bias, nullptr);
  const auto [rows, cols] = shape;
  Tensor y = at::empty_like(x);
  if (x.numel() == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_gelu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    with_gelu_approx(approx, [&](auto a) {
      forward<scalar_t, decltype(a)::value>(x.const_data_ptr<scalar_t>(), b.const_data_ptr<acc_t>(),
                                            y.mutable_data_ptr<scalar_t>(), rows, cols,
                                            stream_output(y));
    });
  });
  return y;
}

std::tuple<Tensor, Tensor> bias_gelu_bwd(const Tensor& grad_out, const Tensor& input,
                                             const Tensor& bias, c10::string_view approximate,
                                             bool bias_grad) {
  const GeluApprox approx = parse_gelu_approx(approximate);
  const auto [x, b, unused, shape] = prepare_bias_op("bias_gelu", input, bias, nullptr);
  const auto [rows, cols] = shape;
  const Tensor dy = prepare_grad("bias_gelu", grad_out, x);
  const auto acc = at::toOpMathType(x.scalar_type());
  Tensor dx = at::empty_like(x);
  Tensor db;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_gelu_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const Dbias mode = !bias_grad                           ? Dbias::kNone
                       : bias.scalar_type() != x.scalar_type() ? Dbias::kFloat32
                                                               : Dbias::kInputDtype;
    ColumnPartials<acc_t> partial(bias_grad ? at::get_num_threads() : 0, cols, acc);
    if (x.numel() > 0) {
      with_gelu_approx(approx, [&](auto a) {
        with_dbias<!std::is_same_v<scalar_t, acc_t>>(mode, [&](auto d) {
          constexpr GeluApprox A = decltype(a)::value;
          constexpr Dbias D = decltype(d)::value;
          const auto* dyp = dy.const_data_ptr<scalar_t>();
          const auto* xp = x.const_data_ptr<scalar_t>();
          auto* dxp = dx.mutable_data_ptr<scalar_t>();
          const bool stream = stream_output(dx);
          // bfloat16 2048x4096 from DRAM: 1.75-2.00 -> 1.54-1.72 ms with a 16-bit bias (a
          // float32 one is never read as 16 bits).
          if constexpr (!std::is_same_v<scalar_t, acc_t> && D != Dbias::kFloat32) {
            if (params_as_16bit(x, cols, {&bias})) {
              const Tensor bt = bias.contiguous();
              backward<scalar_t, A, scalar_t, D>(dyp, xp, bt.const_data_ptr<scalar_t>(), dxp,
                                                 partial, rows, cols, stream);
              return;
            }
          }
          backward<scalar_t, A, acc_t, D>(dyp, xp, b.const_data_ptr<acc_t>(), dxp, partial,
                                          rows, cols, stream);
        });
      });
    }
    db = bias_grad ? partial.sum(bias.scalar_type()) : at::empty({0}, bias.options());
  });
  return {dx, db};
}

}  // namespace torchpar::kernels::cpu::CPU_CAPABILITY
