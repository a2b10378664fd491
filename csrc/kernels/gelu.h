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

// The functions GeLU needs, for scalars on host and device. erfc_over_sqrt2(a) is erfc(a / sqrt2)
// for a >= 0 (an implementation may skip the negative half, and fold the scale into its
// coefficients). gauss(z) is e^{-z^2/2}, and cdf_gauss(z, g) the normal CDF Phi(z) given
// g = gauss(z), which GeLU's gradient computes anyway: an implementation whose erfc is built on
// e^{-x^2} (cpu/vec.h) reuses it; these scalar ones ignore it.
struct ScalarMath {
  template <typename T>
  C10_HOST_DEVICE static T min(T a, T b) { return b < a ? b : a; }
  C10_HOST_DEVICE static float abs(float x) { return ::fabsf(x); }
  C10_HOST_DEVICE static double abs(double x) { return ::fabs(x); }
  C10_HOST_DEVICE static float erfc_over_sqrt2(float a) { return ::erfcf(a * float(kInvSqrt2)); }
  C10_HOST_DEVICE static double erfc_over_sqrt2(double a) { return ::erfc(a * kInvSqrt2); }
  C10_HOST_DEVICE static float gauss(float z) { return ::expf(-0.5f * z * z); }
  C10_HOST_DEVICE static double gauss(double z) { return ::exp(-0.5 * z * z); }
  // 1/2 erfc(-z / sqrt2) keeps Phi's left tail accurate where 1/2 (1 + erf(z / sqrt2)) cancels.
  C10_HOST_DEVICE static float cdf_gauss(float z, float /*g*/) { return 0.5f * ::erfcf(-z * float(kInvSqrt2)); }
  C10_HOST_DEVICE static double cdf_gauss(double z, double /*g*/) { return 0.5 * ::erfc(-z * kInvSqrt2); }
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

// gelu'(z) = Phi(z) + z * phi(z), phi(z) = e^{-z^2/2} / sqrt(2 pi); Phi may reuse the exponential.
template <typename T, typename M = ScalarMath>
C10_HOST_DEVICE inline T gelu_erf_grad(T z) {
  const T g = M::gauss(z);
  return M::cdf_gauss(z, g) + z * g * T(kInvSqrt2Pi);
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
