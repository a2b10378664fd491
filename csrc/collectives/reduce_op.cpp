// One vectorized kernel per dtype x op, instantiated from the functors below.
#include "collectives/reduce_op.h"

#include <ATen/cpu/vec/functional_bfloat16.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <type_traits>

#include "common/error.h"

namespace torchpar::collectives {

using at::vec::Vectorized;

const char* name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "SUM";
    case ReduceOp::kAvg: return "AVG";
    case ReduceOp::kProduct: return "PRODUCT";
    case ReduceOp::kMin: return "MIN";
    case ReduceOp::kMax: return "MAX";
    case ReduceOp::kBand: return "BAND";
    case ReduceOp::kBor: return "BOR";
    case ReduceOp::kBxor: return "BXOR";
  }
  return "?";
}

void check_supported(ReduceOp op, c10::ScalarType dtype) {
  bool bitwise = op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor;
  TP_CHECK_USAGE(!(bitwise && c10::isFloatingType(dtype)), "reduce op ", name(op),
           " is not defined for floating-point dtype ", c10::toString(dtype));
  TP_CHECK_USAGE(!(op == ReduceOp::kAvg && dtype == c10::ScalarType::Bool), "reduce op AVG is not defined for bool");
}

namespace {

// Each functor works on a Vectorized<T> and on a scalar T.
struct Sum {
  template <typename V> V operator()(const V& a, const V& b) const { return a + b; }
};
struct Prod {
  template <typename V> V operator()(const V& a, const V& b) const { return a * b; }
};
struct Min {
  template <typename T> Vectorized<T> operator()(const Vectorized<T>& a, const Vectorized<T>& b) const {
    return at::vec::minimum(a, b);
  }
  template <typename T, typename = std::enable_if_t<!std::is_class_v<T>>>
  T operator()(T a, T b) const {
    if constexpr (std::is_floating_point_v<T>) {
      if (std::isnan(a)) return a;  // NaN wins, as in torch.minimum
      if (std::isnan(b)) return b;
    }
    return b < a ? b : a;
  }
};
struct Max {
  template <typename T> Vectorized<T> operator()(const Vectorized<T>& a, const Vectorized<T>& b) const {
    return at::vec::maximum(a, b);
  }
  template <typename T, typename = std::enable_if_t<!std::is_class_v<T>>>
  T operator()(T a, T b) const {
    if constexpr (std::is_floating_point_v<T>) {
      if (std::isnan(a)) return a;
      if (std::isnan(b)) return b;
    }
    return b > a ? b : a;
  }
};
struct Band {
  template <typename V> V operator()(const V& a, const V& b) const { return a & b; }
};
struct Bor {
  template <typename V> V operator()(const V& a, const V& b) const { return a | b; }
};
struct Bxor {
  template <typename V> V operator()(const V& a, const V& b) const { return a ^ b; }
};

template <typename T>
T divide(T v, int divisor) {
  return static_cast<T>(v / static_cast<T>(divisor));  // integers truncate, like NCCL's AVG
}

// Types that at::vec computes in natively.
template <typename T, typename Op>
void reduce_native(T* dst, const T* const* srcs, int n, size_t count, Op op, int divisor) {
  using V = Vectorized<T>;
  constexpr size_t W = V::size();
  size_t i = 0;
  for (; i + W <= count; i += W) {
    V acc = V::loadu(srcs[0] + i);
    for (int s = 1; s < n; ++s) acc = op(acc, V::loadu(srcs[s] + i));
    if constexpr (std::is_floating_point_v<T>) {
      if (divisor != 1) acc = acc / V(static_cast<T>(divisor));
    }
    acc.store(dst + i);
  }
  for (; i < count; ++i) {
    T acc = srcs[0][i];
    for (int s = 1; s < n; ++s) acc = static_cast<T>(op(acc, srcs[s][i]));
    if constexpr (std::is_floating_point_v<T>) {
      if (divisor != 1) acc = divide(acc, divisor);
    }
    dst[i] = acc;
  }
  if constexpr (!std::is_floating_point_v<T>) {
    // at::vec has no integer division; truncate after the vector loop.
    if (divisor != 1) {
      for (size_t j = 0; j < count; ++j) dst[j] = divide(dst[j], divisor);
    }
  }
}

// bfloat16 / float16: widen to float32, reduce, round once.
template <typename T, typename Op>
void reduce_reduced_float(T* dst, const T* const* srcs, int n, size_t count, Op op, int divisor) {
  using VT = Vectorized<T>;
  using VF = Vectorized<float>;
  constexpr size_t W = VT::size();
  const VF div(static_cast<float>(divisor));
  size_t i = 0;
  for (; i + W <= count; i += W) {
    auto [a0, a1] = at::vec::convert_to_float<T>(VT::loadu(srcs[0] + i));
    for (int s = 1; s < n; ++s) {
      auto [b0, b1] = at::vec::convert_to_float<T>(VT::loadu(srcs[s] + i));
      a0 = op(a0, b0);
      a1 = op(a1, b1);
    }
    if (divisor != 1) {
      a0 = a0 / div;
      a1 = a1 / div;
    }
    at::vec::convert_from_float<T>(a0, a1).store(dst + i);
  }
  for (; i < count; ++i) {
    float acc = static_cast<float>(srcs[0][i]);
    for (int s = 1; s < n; ++s) acc = op(acc, static_cast<float>(srcs[s][i]));
    if (divisor != 1) acc /= static_cast<float>(divisor);
    dst[i] = static_cast<T>(acc);
  }
}

template <typename T, typename Op>
void run(void* dst, const void* const* srcs, int n, size_t count, Op op, int divisor) {
  auto* d = static_cast<T*>(dst);
  auto* s = reinterpret_cast<const T* const*>(srcs);
  if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>) {
    reduce_reduced_float<T>(d, s, n, count, op, divisor);
  } else {
    reduce_native<T>(d, s, n, count, op, divisor);
  }
}

template <typename T>
void dispatch_op(ReduceOp op, void* dst, const void* const* srcs, int n, size_t count, int divisor) {
  switch (op) {
    case ReduceOp::kSum: return run<T>(dst, srcs, n, count, Sum{}, 1);
    case ReduceOp::kAvg: return run<T>(dst, srcs, n, count, Sum{}, divisor);
    case ReduceOp::kProduct: return run<T>(dst, srcs, n, count, Prod{}, 1);
    case ReduceOp::kMin: return run<T>(dst, srcs, n, count, Min{}, 1);
    case ReduceOp::kMax: return run<T>(dst, srcs, n, count, Max{}, 1);
    default: break;
  }
  if constexpr (std::is_integral_v<T>) {
    switch (op) {
      case ReduceOp::kBand: return run<T>(dst, srcs, n, count, Band{}, 1);
      case ReduceOp::kBor: return run<T>(dst, srcs, n, count, Bor{}, 1);
      case ReduceOp::kBxor: return run<T>(dst, srcs, n, count, Bxor{}, 1);
      default: break;
    }
  }
  TP_THROW("reduce op ", name(op), " is not supported for this dtype");
}

// bool is 0/1 bytes: SUM and MAX are OR, PRODUCT and MIN are AND.
ReduceOp bool_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMax: return ReduceOp::kBor;
    case ReduceOp::kProduct:
    case ReduceOp::kMin: return ReduceOp::kBand;
    default: return op;
  }
}

}  // namespace

void reduce(c10::ScalarType dtype, ReduceOp op, void* dst, const void* const* srcs, int n_srcs,
            size_t count, int divisor) {
  using c10::ScalarType;
  switch (dtype) {
    case ScalarType::Float: return dispatch_op<float>(op, dst, srcs, n_srcs, count, divisor);
    case ScalarType::Double: return dispatch_op<double>(op, dst, srcs, n_srcs, count, divisor);
    case ScalarType::BFloat16: return dispatch_op<c10::BFloat16>(op, dst, srcs, n_srcs, count, divisor);
    case ScalarType::Half: return dispatch_op<c10::Half>(op, dst, srcs, n_srcs, count, divisor);
    case ScalarType::Char: return dispatch_op<int8_t>(op, dst, srcs, n_srcs, count, divisor);
    case ScalarType::Byte: return dispatch_op<uint8_t>(op, dst, srcs, n_srcs, count, divisor);
    case ScalarType::Short: return dispatch_op<int16_t>(op, dst, srcs, n_srcs, count, divisor);
    case ScalarType::Int: return dispatch_op<int32_t>(op, dst, srcs, n_srcs, count, divisor);
    case ScalarType::Long: return dispatch_op<int64_t>(op, dst, srcs, n_srcs, count, divisor);
    case ScalarType::Bool: return dispatch_op<uint8_t>(bool_op(op), dst, srcs, n_srcs, count, divisor);
    default: TP_THROW("dtype ", c10::toString(dtype), " is not supported by torchpar reductions");
  }
}

}  // namespace torchpar::collectives
