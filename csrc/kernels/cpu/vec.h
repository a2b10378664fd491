// at::vec glue for the CPU kernels: every dtype is computed in its accumulate type (float
// for float16/bfloat16/float32, double for float64), two accumulate vectors per step so a
// bfloat16 step is one 256-bit load. Kernels loop `for (i = 0; i + kStep <= n; i += kStep)`
// over load2/store2 and finish the tail with the scalar form of the same math; the GeLU
// kernels first take kLanes vectors at a time in lockstep (Lanes, load<K>/store<K>).
#pragma once

// at::vec's headers carry `#pragma unroll` for nvcc, which g++ -Wall reports at every use.
#pragma GCC diagnostic ignored "-Wunknown-pragmas"

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "kernels/cpu/kernels.h"

// In the instruction set's own namespace: each copy of the kernels gets its own (kernels.h).
namespace torchpar::kernels::cpu::CPU_CAPABILITY {

// Non-temporal stores: a plain store first reads its cache line from memory (to own it), so a
// kernel writing an output bigger than the cache moves each output byte twice; a non-temporal
// store skips that read and writes whole lines to memory. For outputs whose consumer would not
// find them in cache anyway (streaming_store_bytes, kernels.h). One thread writing 32 MiB of
// float32 from a 32 MiB input, this machine: 1.46 -> 1.24 ms, and 12.6 -> 9.4 ms at 256 MiB.
inline bool stream_output(const at::Tensor& out) {
  return int64_t(out.nbytes()) >= streaming_store_bytes();
}

#if defined(CPU_CAPABILITY_AVX512)
constexpr uintptr_t kStreamAlign = 64;  // the width of a vector register, which a stream needs
inline void stream_store(void* p, __m512 v) { _mm512_stream_ps(static_cast<float*>(p), v); }
inline void stream_store(void* p, __m512d v) { _mm512_stream_pd(static_cast<double*>(p), v); }
inline void stream_store(void* p, __m512i v) { _mm512_stream_si512(static_cast<__m512i*>(p), v); }
#elif defined(CPU_CAPABILITY_AVX2)
constexpr uintptr_t kStreamAlign = 32;
inline void stream_store(void* p, __m256 v) { _mm256_stream_ps(static_cast<float*>(p), v); }
inline void stream_store(void* p, __m256d v) { _mm256_stream_pd(static_cast<double*>(p), v); }
inline void stream_store(void* p, __m256i v) { _mm256_stream_si256(static_cast<__m256i*>(p), v); }
#endif

// Whether p can take a vector register's non-temporal store: this build has them, and p is
// aligned to the register's width.
inline bool streams_at(const void* p) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return reinterpret_cast<uintptr_t>(p) % kStreamAlign == 0;
#else
  return false;
#endif
}

// Non-temporal stores are weakly ordered: a thread that made them fences before it tells
// another thread (at::parallel_for's join) that its part of the output is written.
inline void stream_fence(bool streamed) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if (streamed) _mm_sfence();
#endif
}

// K float vectors computed in lockstep: every operation is issued for all K before the next
// one starts. GeLU's float math is a chain of ~30 dependent operations per vector, longer
// than the core's scheduler can look past when the vectors of a step follow one another;
// side by side, each step of the chain has K independent operations ready. The GeLU
// backward in cache: 0.31 -> 0.26 ns per element per core (bfloat16, AVX-512), 0.84 -> 0.72 (AVX2).
template <int K>
struct Lanes {
  using VecF = at::vec::Vectorized<float>;
  static constexpr int64_t size() { return K * VecF::size(); }
  VecF v[K];

  Lanes() = default;
  explicit Lanes(float s) {
    for (auto& x : v) x = VecF(s);
  }
  static Lanes loadu(const float* p) {
    Lanes r;
    for (int k = 0; k < K; ++k) r.v[k] = VecF::loadu(p + VecF::size() * k);
    return r;
  }
  void store(float* p) const {
    for (int k = 0; k < K; ++k) v[k].store(p + VecF::size() * k);
  }
  // r.v[k] = f(a.v[k], b.v[k], ...) for k = 0 .. K-1, in that order.
  template <typename F, typename... L>
  static Lanes map(F&& f, const L&... l) {
    Lanes r;
    for (int k = 0; k < K; ++k) r.v[k] = f(l.v[k]...);
    return r;
  }
  Lanes abs() const { return map([](const VecF& a) { return a.abs(); }, *this); }
};

// How many vectors the GeLU kernels advance in lockstep. Measured in cache (GeLU backward,
// bfloat16): AVX-512 8 > 4 > 1, AVX2 4 > 2 > 1; more chains than registers would spill.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif

#define TORCHPAR_LANES_BINARY_OP(op)                                                  \
  template <int K>                                                                    \
  Lanes<K> operator op(const Lanes<K>& a, const Lanes<K>& b) {                        \
    return Lanes<K>::map([](const auto& x, const auto& y) { return x op y; }, a, b); \
  }
TORCHPAR_LANES_BINARY_OP(+)
TORCHPAR_LANES_BINARY_OP(-)
TORCHPAR_LANES_BINARY_OP(*)
TORCHPAR_LANES_BINARY_OP(&)
TORCHPAR_LANES_BINARY_OP(|)
TORCHPAR_LANES_BINARY_OP(^)
#undef TORCHPAR_LANES_BINARY_OP

// The at::vec functions VecMath calls, lane by lane (found by argument-dependent lookup, like
// at::vec's own for a single vector).
template <int K>
Lanes<K> fmadd(const Lanes<K>& a, const Lanes<K>& b, const Lanes<K>& c) {
  return Lanes<K>::map([](const auto& x, const auto& y, const auto& z) { return at::vec::fmadd(x, y, z); },
                       a, b, c);
}
template <int K>
Lanes<K> clamp_max(const Lanes<K>& a, const Lanes<K>& m) {
  return Lanes<K>::map([](const auto& x, const auto& y) { return at::vec::clamp_max(x, y); }, a, m);
}
template <int K>
Lanes<K> clamp(const Lanes<K>& a, const Lanes<K>& lo, const Lanes<K>& hi) {
  return Lanes<K>::map([](const auto& x, const auto& l, const auto& h) { return at::vec::clamp(x, l, h); },
                       a, lo, hi);
}

// The reciprocal's hardware estimate: AVX-512 14 bits, AVX2 12 bits; a divide elsewhere.
inline at::vec::Vectorized<float> reciprocal_estimate(const at::vec::Vectorized<float>& d) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_rcp14_ps(d);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_rcp_ps(d);
#else
  return at::vec::Vectorized<float>(1.f) / d;
#endif
}
template <int K>
Lanes<K> reciprocal_estimate(const Lanes<K>& d) {
  return Lanes<K>::map([](const auto& x) { return reciprocal_estimate(x); }, d);
}

// p * 2^n, for n held as an integer in the low mantissa bits of t (exp's rounding, below):
// shifted into the exponent field and added.
inline at::vec::Vectorized<float> scale_by_pow2(const at::vec::Vectorized<float>& p,
                                                const at::vec::Vectorized<float>& t) {
  using VecI = at::vec::Vectorized<int32_t>;
  const VecI scale = at::vec::cast<int32_t>(t) << VecI(23);
  return at::vec::cast<float>(at::vec::cast<int32_t>(p) + scale);
}
template <int K>
Lanes<K> scale_by_pow2(const Lanes<K>& p, const Lanes<K>& t) {
  return Lanes<K>::map([](const auto& x, const auto& y) { return scale_by_pow2(x, y); }, p, t);
}

// Float vectors, one or K in lockstep: what VecMath's own float math runs on.
template <typename V>
inline constexpr bool kFloatVec = std::is_same_v<V, at::vec::Vectorized<float>>;
template <int K>
inline constexpr bool kFloatVec<Lanes<K>> = true;

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

  // Stores a and b to p[0 .. kStep): with non-temporal stores if `stream` and p is aligned for
  // them (a row that starts misaligned takes plain stores throughout).
  static void store2(T* p, const Vec& a, const Vec& b, bool stream = false) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      // One instruction rounds 32 floats to bfloat16 (nearest-even, NaN kept), where the
      // integer emulation takes about sixteen.
      const __m512i v = __m512i(_mm512_cvtne2ps_pbh(__m512(b), __m512(a)));
      if (stream && streams_at(p)) {
        stream_store(p, v);
      } else {
        _mm512_storeu_si512(p, v);
      }
      return;
    }
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    if (stream && streams_at(p)) {
      if constexpr (kReduced) {
        stream_store(p, at::vec::convert_from_float<T>(a, b));
      } else {
        stream_store(p, a);
        stream_store(p + Vec::size(), b);
      }
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

  // K accumulate vectors (K even) from or to p[0 .. K * Vec::size()).
  template <int K>
  static Lanes<K> load(const T* p) {
    static_assert(K % 2 == 0, "load<K> reads pairs of vectors");
    Lanes<K> l;
    for (int k = 0; k < K; k += 2) load2(p + k * Vec::size(), l.v[k], l.v[k + 1]);
    return l;
  }
  template <int K>
  static void store(T* p, const Lanes<K>& l, bool stream = false) {
    static_assert(K % 2 == 0, "store<K> writes pairs of vectors");
    for (int k = 0; k < K; k += 2) store2(p + k * Vec::size(), l.v[k], l.v[k + 1], stream);
  }
};

// The functions kernels/gelu.h asks of its `M`, for at::vec vectors.
//
// GeLU is compute-bound on a CPU core, so float vectors use an inline exp of their own (below)
// instead of calls into Sleef's 1-ulp functions, and erfc by Abramowitz & Stegun's rational
// forms (7.1.28 alone, 7.1.26 where e^{-x^2} is at hand). All stay within about 1e-6 of the
// exact value: below float16/bfloat16 rounding, and below the noise of float32 training.
// Double vectors keep the accurate functions (gradcheck compares to finite differences).
//
// kFullPrecision = false is for results rounded to 16 bits: reciprocal_factor then keeps
// AVX-512's 14-bit reciprocal estimate without a Newton step (the step is 2 of GeLU's ~20
// operations). The forwards only scale by it, so its relative error (6e-5, a tenth of
// float16's half-ulp) passes to the result unamplified. The erf gradient's tail Q takes one
// too, and Q - |z| phi cancels near the gradient's root (z = -0.75): there bfloat16 results
// stay within 1.7 ulps, but float16's three more bits saw 19, so a float16 gradient asks for
// full precision (gelu_grad_full_precision). reciprocal is always the full one.
template <bool kFullPrecision = true>
struct VecMath {
  template <typename V>
  static V abs(const V& x) { return x.abs(); }
  template <typename V>
  static V min(const V& a, const V& b) { return clamp_max(a, b); }

  // 2^f for |f| <= 1/2, by the Taylor polynomial of e^{f ln2}: degree 6 (relative error below
  // 1.3e-7), or 5 for results rounded to 16 bits (2.4e-6, a hundredth of float16's half-ulp).
  template <typename V>
  static V exp2_fraction(const V& f) {
    const V c4(9.6181291e-3f), c5(1.3333558e-3f), c6(1.5403530e-4f);
    V p = kFullPrecision ? fmadd(fmadd(c6, f, c5), f, c4) : fmadd(c5, f, c4);
    p = fmadd(p, f, V(5.5504109e-2f));
    p = fmadd(p, f, V(2.4022651e-1f));
    p = fmadd(p, f, V(6.9314718e-1f));
    return fmadd(p, f, V(1.f));
  }

  // e^x = 2^n 2^f with n = round(x log2 e) and f = x log2 e - n in [-1/2, 1/2]. Adding
  // 1.5 * 2^23 rounds x log2 e to an integer held in the low bits of the sum's mantissa, from
  // where a shift moves n into the exponent field; subtracting it back gives -n exactly, and
  // an FMA then gives f with x log2 e unrounded. The clamp keeps 2^n a normal float (a NaN x
  // yields garbage, but every GeLU formula also multiplies by x, which keeps the NaN). About
  // 12 vector operations to the 18 of at::vec's exp_u20, which handles the range with
  // compares and blends: the GeLU backward ran 10-14% faster.
  template <typename V>
    requires kFloatVec<V>
  static V exp(const V& x) {
    const V shifter(12582912.f), log2e(1.44269504f);
    const V xc = clamp(x, V(-87.f), V(88.f));
    const V t = fmadd(xc, log2e, shifter);
    return scale_by_pow2(exp2_fraction(fmadd(xc, log2e, shifter - t)), t);
  }

  // e^{-a^2/2} as exp above, with -log2(e)/2 as the one constant and only the lower clamp
  // (a^2 <= 174 keeps 2^n normal; a NaN passes the min and stays NaN).
  template <typename V>
    requires kFloatVec<V>
  static V gauss(const V& a) {
    const V shifter(12582912.f), c(-0.72134752f);
    const V w = clamp_max(a * a, V(174.f));
    const V t = fmadd(w, c, shifter);
    return scale_by_pow2(exp2_fraction(fmadd(w, c, shifter - t)), t);
  }

  // 1 / d by the hardware estimate and one Newton step (~23 bits): a divide has a quarter of
  // the throughput, and GeLU's erf and tanh need one per element.
  template <typename V>
    requires kFloatVec<V>
  static V reciprocal(const V& d) {
    const V r = reciprocal_estimate(d);
    return r * (V(2.f) - d * r);
  }

  // 1 / d for a factor of a result that kFullPrecision = false rounds to 16 bits.
  template <typename V>
    requires kFloatVec<V>
  static V reciprocal_factor(const V& d) {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (!kFullPrecision) return reciprocal_estimate(d);
#endif
    return reciprocal(d);
  }

  // erfc(a / sqrt2) for a >= 0 by Abramowitz & Stegun 7.1.28, |error| <= 3e-7, which needs
  // no exp: erfc(x) = 1 / (1 + a1 x + ... + a6 x^6)^16, here with a_k 2^{-k/2} as the
  // coefficients so that GeLU's a = |z| goes in unscaled. About 13 vector operations to
  // 7.1.26's 25. Past x = 6 (a = 6 sqrt2), erfc is below 1e-16; clamping there keeps the 16th
  // power finite (and a NaN stays NaN: the min returns its second operand when one is NaN).
  template <typename V>
    requires kFloatVec<V>
  static V erfc_over_sqrt2(const V& a) {
    const V c1(4.9867346967e-02f), c2(2.1141006150e-02f), c3(3.2776263241e-03f),
        c4(3.8003575000e-05f), c5(4.8890635643e-05f), c6(5.3829750000e-06f), one(1.f);
    const V x = clamp_max(a, V(8.48528137f));
    V d = fmadd(c6, x, c5);
    d = fmadd(d, x, c4);
    d = fmadd(d, x, c3);
    d = fmadd(d, x, c2);
    d = fmadd(d, x, c1);
    d = fmadd(d, x, one);
    d = d * d;  // ^2
    d = d * d;  // ^4
    d = d * d;  // ^8
    d = d * d;  // ^16
    return reciprocal_factor(d);
  }

  // The upper tail Q(a) = erfc(a / sqrt2) / 2, a >= 0, given g = e^{-a^2/2}, by Abramowitz &
  // Stegun 7.1.26: erfc(x) = t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) e^{-x^2},
  // t = 1 / (1 + p x) (|error| <= 1.5e-7). With x = a / sqrt2 the scale goes into p, and the
  // 1/2 into the a_k. Relative accuracy holds far into the tail, where 1/2 (1 - erf) cancels.
  template <typename V>
    requires kFloatVec<V>
  static V gauss_tail(const V& a, const V& g) {
    const V p(0.231641888f), a1(0.127414796f), a2(-0.142248368f), a3(0.7107068705f),
        a4(-0.7265760135f), a5(0.5307027145f), one(1.f);
    const V t = reciprocal_factor(fmadd(p, a, one));
    V q = fmadd(a5, t, a4);
    q = fmadd(q, t, a3);
    q = fmadd(q, t, a2);
    q = fmadd(q, t, a1) * t;
    return q * g;
  }

  // 1 - q for z >= 0 and q for z < 0, without a branch, from z's sign bit s: the step
  // H = 1/2 + (1/2 ^ s) minus (q ^ s). A NaN z carries a NaN q (every caller's q is
  // computed from |z|), so the result is NaN.
  template <typename V>
  static V one_sided(const V& z, const V& q) {
    const V half(0.5f);
    const V s = z & V(-0.f);
    return (half + (half ^ s)) - (q ^ s);
  }

  // Double vectors: at::vec's accurate functions.
  template <typename V>
    requires(!kFloatVec<V>)
  static V exp(const V& x) { return x.exp(); }
  template <typename V>
    requires(!kFloatVec<V>)
  static V reciprocal(const V& d) { return V(1.0) / d; }
  template <typename V>
    requires(!kFloatVec<V>)
  static V reciprocal_factor(const V& d) { return V(1.0) / d; }
  template <typename V>
    requires(!kFloatVec<V>)
  static V erfc_over_sqrt2(const V& a) { return (a * V(0.70710678118654752440)).erfc(); }
  template <typename V>
    requires(!kFloatVec<V>)
  static V gauss(const V& a) { return (a * a * V(-0.5)).exp(); }
  template <typename V>
    requires(!kFloatVec<V>)
  static V gauss_tail(const V& a, const V& /*g*/) { return (a * V(0.70710678118654752440)).erfc() * V(0.5); }
};

// Whether GeLU's gradient for results of type T needs VecMath's full precision (above):
// everything but bfloat16 results. On AVX-512, near the root, over [-1, -0.5]: bfloat16 1.7
// ulps at most (93 % correctly rounded) with the estimate; float16 19 ulps (62 %) with it,
// 2.3 ulps (99 %) without. In cache the full form costs the bfloat16 backward 10 %.
template <typename T>
inline constexpr bool gelu_grad_full_precision = !std::is_same_v<T, c10::BFloat16>;

// Asks for p[0 .. n) to be brought into cache ahead of use, a line at a time: for a loop that
// computes for a while (drawing dropout words) before it streams the next row.
template <typename T>
inline void prefetch(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < n * int64_t(sizeof(T)); b += 64) __builtin_prefetch(c + b);
}

// Rows wider than this read a 16-bit bias or weight as 16 bits rather than as a float copy.
// Every row touches every column's parameters (and, in a backward, its dbias/dweight
// partials); past 2048 columns those float vectors fill a third of L1 and more, the row's own
// data streaming through evicts them, and a 16-bit copy halves their share. Narrower rows
// keep the float copy, which saves a conversion per vector. From DRAM at 2048x4096, bfloat16:
// layer_norm forward 30 % faster, the GeLU backward 12 %, bias_dropout_add's forward 3-5 %.
constexpr int64_t kWideRow = 2048;

// Whether a kernel on 16-bit `x` reads its parameters as 16 bits: rows wider than kWideRow,
// and every parameter given (null or undefined: absent) of x's dtype. A float32 parameter
// beside 16-bit input (mixed precision, kernels/ops.h) keeps its float copy: rounding it
// would change the result.
inline bool params_as_16bit(const at::Tensor& x, int64_t cols,
                            std::initializer_list<const at::Tensor*> params) {
  if (!at::isReducedFloatingType(x.scalar_type()) || cols <= kWideRow) return false;
  for (const at::Tensor* p : params) {
    if (p != nullptr && p->defined() && p->scalar_type() != x.scalar_type()) return false;
  }
  return true;
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
