// GeLU and its derivative (Hendrycks & Gimpel, arXiv:1606.08415), written once for every
// element type: T is a scalar (float, double: CPU tails and CUDA) or an at::vec vector
// (CPU main loops). `M` supplies erfc, exp and the rest for T, so the formulas stay identical
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
// coefficients). gauss(a) is e^{-a^2/2}, and gauss_tail(a, g) the normal distribution's upper
// tail 1 - Phi(a) = erfc(a / sqrt2) / 2 for a >= 0, given g = gauss(a), which GeLU's gradient
// computes anyway: an implementation whose erfc is built on e^{-x^2} (cpu/vec.h) reuses it;
// these scalar ones ignore it. one_sided(z, q) is 1 - q for z >= 0 and q for z < 0: a value on
// z's side from a tail q computed for |z|, with no cancellation on the negative side.
// reciprocal(d) is 1 / d to T's precision; reciprocal_factor(d) may be less accurate (VecMath's
// for 16-bit results), for a reciprocal that only scales a result.
struct ScalarMath {
  template <typename T>
  C10_HOST_DEVICE static T min(T a, T b) { return b < a ? b : a; }
  C10_HOST_DEVICE static float abs(float x) { return ::fabsf(x); }
  C10_HOST_DEVICE static double abs(double x) { return ::fabs(x); }
  C10_HOST_DEVICE static float exp(float x) { return ::expf(x); }
  C10_HOST_DEVICE static double exp(double x) { return ::exp(x); }
  template <typename T>
  C10_HOST_DEVICE static T reciprocal(T d) { return T(1) / d; }
  template <typename T>
  C10_HOST_DEVICE static T reciprocal_factor(T d) { return T(1) / d; }
  C10_HOST_DEVICE static float erfc_over_sqrt2(float a) { return ::erfcf(a * float(kInvSqrt2)); }
  C10_HOST_DEVICE static double erfc_over_sqrt2(double a) { return ::erfc(a * kInvSqrt2); }
  C10_HOST_DEVICE static float gauss(float a) { return ::expf(-0.5f * a * a); }
  C10_HOST_DEVICE static double gauss(double a) { return ::exp(-0.5 * a * a); }
  C10_HOST_DEVICE static float gauss_tail(float a, float /*g*/) { return 0.5f * ::erfcf(a * float(kInvSqrt2)); }
  C10_HOST_DEVICE static double gauss_tail(double a, double /*g*/) { return 0.5 * ::erfc(a * kInvSqrt2); }
  template <typename T>
  C10_HOST_DEVICE static T one_sided(T z, T q) { return z < T(0) ? q : T(1) - q; }
};

// Past |z| = 40 every tail term below is 0 in float and double alike (e^{-800} and smaller),
// but an approximate exponential may keep a small floor there (cpu/vec.h's stops at e^{-87}):
// capping the factor |z| that multiplies such a term keeps the floor from growing with |z|,
// and +-inf from meeting 0.
constexpr double kTailCap = 40.0;

// gelu(z) = z * Phi(z), Phi the standard normal CDF, written as
// (z + |z|) / 2 - |z| erfc(|z| / sqrt2) / 2. For z < 0 the first term is exactly 0, so the left
// tail is as accurate as erfc (relatively, with the exact one; cpu/vec.h's float erfc is
// within 3e-7 absolutely), where z (1 + erf(z / sqrt2)) / 2 would cancel; and erfc is needed
// for non-negative arguments only.
template <typename T, typename M = ScalarMath>
C10_HOST_DEVICE inline T gelu_erf(T z) {
  const T a = M::abs(z);
  const T h = T(0.5) * a;
  return (T(0.5) * z + h) - M::min(h, T(0.5 * kTailCap)) * M::erfc_over_sqrt2(a);
}

// gelu'(z) = Phi(z) + z phi(z), phi(z) = g / sqrt(2 pi) with g = e^{-z^2/2}. With a = |z| and
// the tail Q = 1 - Phi(a): 1 - (Q - a phi) for z >= 0 and Q - a phi for z < 0 (there
// Phi(z) = Q and z phi = -a phi), which one_sided takes from z's sign. a is capped
// (kTailCap), so that +-inf gives 1 and 0.
template <typename T, typename M = ScalarMath>
C10_HOST_DEVICE inline T gelu_erf_grad(T z) {
  const T a = M::min(M::abs(z), T(kTailCap));
  const T g = M::gauss(a);
  return M::one_sided(z, M::gauss_tail(a, g) - a * g * T(kInvSqrt2Pi));
}

// The tanh approximation 0.5 z (1 + tanh(u)), u = sqrt(2/pi) (z + 0.044715 z^3), is
// z sigma(2u), sigma the logistic function. With a = |z|, e = e^{-2u(a)} in [0, 1] and
// s = e / (1 + e) = sigma(-2u(a)), the smaller of sigma(+-2u): gelu(z) = (z + a) / 2 - a s, the
// form of gelu_erf above. No tanh: 1 + tanh(u) cancels for u < 0, and tanh(u) rounds to +-1
// before 1 - tanh^2, which the gradient needs, reaches 0.
template <typename T, typename M = ScalarMath>
C10_HOST_DEVICE inline T gelu_tanh(T z) {
  const T a = M::abs(z);
  const T e = M::exp(a * (T(-2 * kSqrt2OverPi) + T(-2 * kSqrt2OverPi * kGeluTanhCoef) * a * a));
  const T s = e * M::reciprocal_factor(T(1) + e);
  return (T(0.5) * z + T(0.5) * a) - M::min(a, T(kTailCap)) * s;
}

// gelu'(z) = sigma(2u) + 2 z u'(z) sigma(2u) sigma(-2u), and sigma(2u) sigma(-2u) = s r with
// r = 1 / (1 + e): one_sided(z, s (1 - a r 2u'(a))), as gelu_erf_grad. r is a full reciprocal:
// 1 - a r 2u' cancels near the gradient's root (z = -0.75), where a 14-bit r left float16
// gradients 35 % off.
template <typename T, typename M = ScalarMath>
C10_HOST_DEVICE inline T gelu_tanh_grad(T z) {
  const T a = M::min(M::abs(z), T(kTailCap));
  const T a2 = a * a;
  const T e = M::exp(a * (T(-2 * kSqrt2OverPi) + T(-2 * kSqrt2OverPi * kGeluTanhCoef) * a2));
  const T r = M::reciprocal(T(1) + e);
  const T du2 = T(2 * kSqrt2OverPi) + T(6 * kSqrt2OverPi * kGeluTanhCoef) * a2;
  return M::one_sided(z, e * r * (T(1) - a * r * du2));
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
