// at::vec glue for the CPU kernels: every dtype is computed in its accumulate type (float
// for float16/bfloat16/float32, double for float64), two accumulate vectors per step so a
// bfloat16 step is one 256-bit load. Kernels loop `for (i = 0; i + kStep <= n; i += kStep)`
// over load2/store2 and finish the tail with the scalar form of the same math.
#pragma once

// at::vec's headers carry `#pragma unroll` for nvcc, which g++ -Wall reports at every use.
#pragma GCC diagnostic ignored "-Wunknown-pragmas"

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <type_traits>

// In the instruction set's own namespace: each copy of the kernels gets its own (kernels.h).
namespace torchpar::kernels::cpu::CPU_CAPABILITY {

template <typename T>
struct VecIO {
  using acc_t = at::opmath_type<T>;
  using Vec = at::vec::Vectorized<acc_t>;
  static constexpr int64_t kStep = 2 * Vec::size();
  static constexpr bool kReduced = !std::is_same_v<T, acc_t>;

  static void load2(const T* p, Vec& a, Vec& b) {
    if constexpr (kReduced) {
      at::vec::load_to_float<T>(p, a, b);
    } else {
      a = Vec::loadu(p);
      b = Vec::loadu(p + Vec::size());
    }
  }

  static void store2(T* p, const Vec& a, const Vec& b) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      // One instruction rounds 32 floats to bfloat16 (nearest-even, NaN kept), where the
      // integer emulation takes about sixteen.
      _mm512_storeu_si512(p, __m512i(_mm512_cvtne2ps_pbh(__m512(b), __m512(a))));
      return;
    }
#endif
    if constexpr (kReduced) {
      at::vec::convert_from_float<T>(a, b).store(p);
    } else {
      a.store(p);
      b.store(p + Vec::size());
    }
  }
};

// abs/erf/erfc/exp/tanh of at::vec vectors, for the formulas in kernels/gelu.h.
//
// GeLU is compute-bound on a CPU core, so float vectors use an inline exp of their own (below)
// instead of calls into Sleef's 1-ulp functions, erfc and erf by Abramowitz &
// Stegun's rational forms (7.1.28 alone, 7.1.26 where e^{-x^2} is at hand), tanh through exp.
// All stay within about 1e-6 of the exact value: below float16/bfloat16 rounding, and below
// the noise of float32 training. Double vectors keep the accurate functions (gradcheck
// compares to finite differences).
//
// kFullPrecision = false is for results rounded to bfloat16/float16: erfc then keeps
// AVX-512's 14-bit reciprocal estimate without a Newton step. GeLU only scales by erfc, so its
// relative error (6e-5) passes to the result unamplified, a tenth of float16's half-ulp; the
// step is 2 of GeLU's ~20 operations. tanh keeps the step: 1 + tanh(u) cancels as u -> -inf.
template <bool kFullPrecision = true>
struct VecMath {
  using VecF = at::vec::Vectorized<float>;

  static VecF abs(const VecF& x) { return x.abs(); }
  static VecF min(const VecF& a, const VecF& b) { return at::vec::clamp_max(a, b); }
  // e^x = 2^n e^r with n = round(x log2 e) and |r| <= ln2 / 2, e^r by its Taylor polynomial
  // of degree 6 (relative error below 1.3e-7). Adding 1.5 * 2^23 rounds x log2 e to an integer
  // held in the low bits of the sum's mantissa, from where a shift moves n into the exponent
  // field. The clamp keeps 2^n a normal float (a NaN x yields garbage, but every GeLU formula
  // also multiplies by x, which keeps the NaN). About 12 vector operations to the 18 of
  // at::vec's exp_u20, which handles the range with compares and blends: the GeLU backward
  // ran 10-14% faster (bfloat16: 0.41 -> 0.37 ns per element per core in cache).
  static VecF exp(const VecF& x) {
    const VecF shifter(12582912.f);
    const VecF xc = at::vec::clamp(x, VecF(-87.f), VecF(88.f));
    const VecF t = at::vec::fmadd(xc, VecF(1.44269504f), shifter);
    const VecF n = t - shifter;
    const VecF r = at::vec::fmadd(n, VecF(-0.693147181f), xc);
    VecF p = at::vec::fmadd(VecF(1.f / 720), r, VecF(1.f / 120));
    p = at::vec::fmadd(p, r, VecF(1.f / 24));
    p = at::vec::fmadd(p, r, VecF(1.f / 6));
    p = at::vec::fmadd(p, r, VecF(0.5f));
    p = at::vec::fmadd(p, r, VecF(1.f));
    p = at::vec::fmadd(p, r, VecF(1.f));
    using VecI = at::vec::Vectorized<int32_t>;
    const VecI scale = at::vec::cast<int32_t>(t) << VecI(23);
    return at::vec::cast<float>(at::vec::cast<int32_t>(p) + scale);
  }

  // 1 / d by the hardware estimate and one Newton step (~23 bits): a divide has a quarter of
  // the throughput, and GeLU's erf and tanh need one per element.
  static VecF reciprocal(const VecF& d) {
#if defined(CPU_CAPABILITY_AVX512)
    const VecF r(_mm512_rcp14_ps(d));  // 14 bits
#elif defined(CPU_CAPABILITY_AVX2)
    const VecF r(_mm256_rcp_ps(d));  // 12 bits
#else
    const VecF r = VecF(1.f) / d;  // no estimate instruction: divide (the step keeps it)
#endif
    return r * (VecF(2.f) - d * r);
  }

  // 1 / d for a factor of a result that kFullPrecision = false rounds to 16 bits.
  static VecF reciprocal_factor(const VecF& d) {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (!kFullPrecision) return VecF(_mm512_rcp14_ps(d));
#endif
    return reciprocal(d);
  }

  // erfc(a / sqrt2) for a >= 0 by Abramowitz & Stegun 7.1.28, |error| <= 3e-7, which needs
  // no exp: erfc(x) = 1 / (1 + a1 x + ... + a6 x^6)^16, here with a_k 2^{-k/2} as the
  // coefficients so that GeLU's a = |z| goes in unscaled. About 13 vector operations to
  // 7.1.26's 25. Past x = 6 (a = 6 sqrt2), erfc is below 1e-16; clamping there keeps the 16th
  // power finite (and a NaN stays NaN: the min returns its second operand when one is NaN).
  static VecF erfc_over_sqrt2(const VecF& a) {
    const VecF c1(4.9867346967e-02f), c2(2.1141006150e-02f), c3(3.2776263241e-03f),
        c4(3.8003575000e-05f), c5(4.8890635643e-05f), c6(5.3829750000e-06f), one(1.f);
    const VecF x = at::vec::clamp_max(a, VecF(8.48528137f));
    VecF d = at::vec::fmadd(c6, x, c5);
    d = at::vec::fmadd(d, x, c4);
    d = at::vec::fmadd(d, x, c3);
    d = at::vec::fmadd(d, x, c2);
    d = at::vec::fmadd(d, x, c1);
    d = at::vec::fmadd(d, x, one);
    d = d * d;  // ^2
    d = d * d;  // ^4
    d = d * d;  // ^8
    d = d * d;  // ^16
    return reciprocal_factor(d);
  }

  // erf(x) given g = e^{-x^2}:
  // erf(|x|) = 1 - t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) g,  t = 1 / (1 + p |x|).
  static VecF erf_gauss(const VecF& x, const VecF& g) {
    const VecF p(0.3275911f), a1(0.254829592f), a2(-0.284496736f), a3(1.421413741f),
        a4(-1.453152027f), a5(1.061405429f), one(1.f), sign_bit(-0.f);
    const VecF sign = x & sign_bit;
    const VecF t = reciprocal(at::vec::fmadd(p, x.abs(), one));
    VecF poly = at::vec::fmadd(a5, t, a4);
    poly = at::vec::fmadd(poly, t, a3);
    poly = at::vec::fmadd(poly, t, a2);
    poly = at::vec::fmadd(poly, t, a1) * t;
    const VecF r = one - poly * g;
    return r | sign;  // r >= 0, so or-ing in x's sign bit gives erf(x) = sign(x) erf(|x|)
  }

  static VecF tanh(const VecF& x) {
    // tanh(u) = 1 - 2 / (e^{2u} + 1); |u| > 9 rounds to +-1 in float anyway.
    const VecF one(1.f), two(2.f);
    const VecF u = at::vec::clamp(x, VecF(-9.f), VecF(9.f));
    return one - two * reciprocal(exp(u + u) + one);
  }

  template <typename V>
  static V abs(const V& x) { return x.abs(); }
  template <typename V>
  static V min(const V& a, const V& b) { return at::vec::clamp_max(a, b); }
  template <typename V>
  static V erfc_over_sqrt2(const V& a) { return (a * V(0.70710678118654752440)).erfc(); }
  template <typename V>
  static V erf_gauss(const V& x, const V& /*g*/) { return x.erf(); }
  template <typename V>
  static V exp(const V& x) { return x.exp(); }
  template <typename V>
  static V tanh(const V& x) { return x.tanh(); }
};

// Asks for p[0 .. n) to be brought into cache ahead of use, a line at a time: for a loop that
// computes for a while (drawing dropout words) before it streams the next row.
template <typename T>
inline void prefetch(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < n * int64_t(sizeof(T)); b += 64) __builtin_prefetch(c + b);
}

// Rows per at::parallel_for task: enough work (~32K elements) to amortise a task's start.
inline int64_t row_grain(int64_t cols) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1));
}

// Per-thread accumulators of a column sum (dbias, dweight): one float row per thread,
// summed at the end. Rows of the reduction are split over threads by at::parallel_for,
// so each thread owns a row of `partial` and nothing is shared while the loops run.
template <typename acc_t>
struct ColumnPartials {
  at::Tensor partial;  // [threads, cols]
  ColumnPartials(int64_t threads, int64_t cols, at::ScalarType acc_type)
      : partial(at::zeros({threads, cols}, at::TensorOptions().dtype(acc_type))) {}
  acc_t* row(int64_t thread) { return partial.data_ptr<acc_t>() + thread * partial.size(1); }
  // Sum over threads, cast to `dtype`.
  at::Tensor sum(at::ScalarType dtype) const { return partial.sum(0).to(dtype); }
};

}  // namespace torchpar::kernels::cpu::CPU_CAPABILITY
