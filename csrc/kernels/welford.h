// Welford's running mean and variance (Welford 1962), merged with Chan, Golub & LeVeque's
// pairwise update (1979). One pass over a row, no cancellation from sum(x^2) - sum(x)^2.
// T is a scalar or an at::vec vector of lane-wise accumulators; C, the count, is a scalar
// because every lane of a vector sees the same number of elements.
#pragma once

#include <c10/macros/Macros.h>

namespace torchpar::kernels {

template <typename T, typename C = T>
struct Welford {
  T mean;
  T m2;  // sum of squared deviations from the mean
  C n;

  C10_HOST_DEVICE Welford() : mean(0), m2(0), n(0) {}
  C10_HOST_DEVICE Welford(T mean_, T m2_, C n_) : mean(mean_), m2(m2_), n(n_) {}

  C10_HOST_DEVICE void push(T x) {
    n = n + C(1);
    T d = x - mean;
    mean = mean + d * T(C(1) / n);
    m2 = m2 + d * (x - mean);
  }

  C10_HOST_DEVICE void merge(const Welford& o) {
    if (o.n == C(0)) return;
    if (n == C(0)) {
      *this = o;
      return;
    }
    C total = n + o.n;
    C w = o.n / total;
    T d = o.mean - mean;
    mean = mean + d * T(w);
    m2 = m2 + o.m2 + d * d * T(n * w);
    n = total;
  }

  // Population variance, as LayerNorm uses.
  C10_HOST_DEVICE T var() const { return m2 / T(n); }
};

}  // namespace torchpar::kernels
