// GeLU and its derivative (Hendrycks & Gimpel, arXiv:1606.08415), written once for every
// element type: T is a scalar (float, double: CPU tails and CUDA) or an at::vec vector
// (CPU main loops). `M` supplies erf, exp and tanh for T, so the formulas stay identical
// on every path and the CPU tests exercise the math the CUDA kernels run.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>

namespace torchpar::kernels {

enum class GeluApprox : int { None = 0, Tanh = 1 };

constexpr double kInvSqrt2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kGeluTanhCoef = 0.044715;

// abs/erf/erfc/exp/tanh for scalars on host and device. erf_gauss(x, g) is erf(x) given
// g = exp(-x^2), which GeLU's gradient computes anyway: an implementation whose erf is built
// on exp(-x^2) (cpu/vec.h) reuses it; these scalar ones ignore it. erfc_over_sqrt2(a) is
// erfc(a / sqrt2) for a >= 0 (an implementation may skip the negative half, and fold the
// scale into its coefficients).
struct ScalarMath {
  template <typename T>
  C10_HOST_DEVICE static T erf_gauss(T x, T /*g*/) { return erf(x); }
  template <typename T>
  C10_HOST_DEVICE static T min(T a, T b) { return b < a ? b : a; }
  C10_HOST_DEVICE static float abs(float x) { return ::fabsf(x); }
  C10_HOST_DEVICE static double abs(double x) { return ::fabs(x); }
  C10_HOST_DEVICE static float erf(float x) { return ::erff(x); }
  C10_HOST_DEVICE static double erf(double x) { return ::erf(x); }
  C10_HOST_DEVICE static float erfc_over_sqrt2(float a) { return ::erfcf(a * float(kInvSqrt2)); }
  C10_HOST_DEVICE static double erfc_over_sqrt2(double a) { return ::erfc(a * kInvSqrt2); }
  C10_HOST_DEVICE static float exp(float x) { return ::expf(x); }
  C10_HOST_DEVICE static double exp(double x) { return ::exp(x); }
  C10_HOST_DEVICE static float tanh(float x) { return ::tanhf(x); }
  C10_HOST_DEVICE static double tanh(double x) { return ::tanh(x); }
};

// gelu(z) = z * Phi(z), Phi the standard normal CDF, written as
// (z + |z|) / 2 - |z| erfc(|z| / sqrt2) / 2. For z < 0 the first term is exactly 0, so the left
// tail keeps its relative accuracy where z (1 + erf(z / sqrt2)) / 2 would cancel; and erf is
// needed for non-negative arguments only.
// The tail term's factor |z|/2 is capped at 15: past |z| = 30 erfc is below 1e-196, and the
// cap keeps an approximate erfc's small floor from growing with |z| (and +inf from meeting 0).
template <typename T, typename M = ScalarMath>
C10_HOST_DEVICE inline T gelu_erf(T z) {
  const T a = M::abs(z);
  const T h = T(0.5) * a;
  return (T(0.5) * z + h) - M::min(h, T(15)) * M::erfc_over_sqrt2(a);
}

// gelu'(z) = Phi(z) + z * phi(z); phi and erf share exp(-z^2 / 2).
template <typename T, typename M = ScalarMath>
C10_HOST_DEVICE inline T gelu_erf_grad(T z) {
  T g = M::exp(T(-0.5) * z * z);
  T cdf = T(0.5) * (T(1.0) + M::erf_gauss(z * T(kInvSqrt2), g));
  return cdf + z * g * T(kInvSqrt2Pi);
}

// The tanh approximation: 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))).
template <typename T, typename M = ScalarMath>
C10_HOST_DEVICE inline T gelu_tanh(T z) {
  T inner = T(kSqrt2OverPi) * (z + T(kGeluTanhCoef) * z * z * z);
  return T(0.5) * z * (T(1.0) + M::tanh(inner));
}

template <typename T, typename M = ScalarMath>
C10_HOST_DEVICE inline T gelu_tanh_grad(T z) {
  T z2 = z * z;
  T t = M::tanh(T(kSqrt2OverPi) * (z + T(kGeluTanhCoef) * z2 * z));
  T dinner = T(kSqrt2OverPi) * (T(1.0) + T(3.0 * kGeluTanhCoef) * z2);
  return T(0.5) * (T(1.0) + t) + T(0.5) * z * (T(1.0) - t * t) * dinner;
}

template <typename T, typename M = ScalarMath>
C10_HOST_DEVICE inline T gelu(T z, GeluApprox approx) {
  return approx == GeluApprox::Tanh ? gelu_tanh<T, M>(z) : gelu_erf<T, M>(z);
}

template <typename T, typename M = ScalarMath>
C10_HOST_DEVICE inline T gelu_grad(T z, GeluApprox approx) {
  return approx == GeluApprox::Tanh ? gelu_tanh_grad<T, M>(z) : gelu_erf_grad<T, M>(z);
}

}  // namespace torchpar::kernels
