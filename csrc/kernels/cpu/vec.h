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

#include <type_traits>

namespace torchpar::kernels::cpu {

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
    if constexpr (kReduced) {
      at::vec::convert_from_float<T>(a, b).store(p);
    } else {
      a.store(p);
      b.store(p + Vec::size());
    }
  }
};

// erf/exp/tanh of at::vec vectors, for the formulas in kernels/gelu.h.
struct VecMath {
  template <typename V>
  static V erf(const V& x) { return x.erf(); }
  template <typename V>
  static V exp(const V& x) { return x.exp(); }
  template <typename V>
  static V tanh(const V& x) { return x.tanh(); }
};

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

}  // namespace torchpar::kernels::cpu
