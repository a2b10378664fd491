// The dropout words of a run of elements (kernels/dropout.h's rule), sixteen Philox blocks
// at a time in AVX2 lanes: Philox, not memory, bounds the dropout kernels on this CPU, and
// in lanes it runs several times faster than scalar. The scalar form in philox.h stays the
// definition: the edges of a run use it, and the tests check both agree.
#pragma once

#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernels/dropout.h"

namespace torchpar::kernels::cpu {

#if defined(__AVX2__)
namespace detail {

// (hi, lo) halves of a * m per 32-bit lane; mul_epu32 multiplies the even lanes only.
inline void mulhilo8(__m256i a, __m256i m, __m256i& hi, __m256i& lo) {
  __m256i even = _mm256_mul_epu32(a, m);
  __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

struct Philox8State {
  __m256i c0, c1, c2, c3;  // word j of the eight blocks' counters, then of their outputs

  Philox8State() = default;
  explicit Philox8State(uint64_t first)
      // Counters built in registers: writing them to memory as scalars and reloading them as
      // one vector stalls on store-to-load forwarding, which cost more than the ten rounds.
      : c0(_mm256_add_epi32(_mm256_set1_epi32(int(uint32_t(first))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))),
        c1(_mm256_set1_epi32(int(uint32_t(first >> 32)))),
        c2(_mm256_setzero_si256()),
        c3(_mm256_setzero_si256()) {}

  void round(__m256i m0, __m256i m1, __m256i k0, __m256i k1) {
    __m256i hi0, lo0, hi1, lo1;
    mulhilo8(c0, m0, hi0, lo0);
    mulhilo8(c2, m1, hi1, lo1);
    c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), k0);
    c1 = lo1;
    c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), k1);
    c3 = lo0;
  }

  // Lane k of c_j is word j of block k; memory wants block-major order: a 4x8 transpose.
  void store(uint32_t* out) const {
    __m256i t0 = _mm256_unpacklo_epi32(c0, c1), t1 = _mm256_unpackhi_epi32(c0, c1);
    __m256i t2 = _mm256_unpacklo_epi32(c2, c3), t3 = _mm256_unpackhi_epi32(c2, c3);
    __m256i b04 = _mm256_unpacklo_epi64(t0, t2), b15 = _mm256_unpackhi_epi64(t0, t2);
    __m256i b26 = _mm256_unpacklo_epi64(t1, t3), b37 = _mm256_unpackhi_epi64(t1, t3);
    auto* o = reinterpret_cast<__m256i*>(out);
    _mm256_storeu_si256(o + 0, _mm256_permute2x128_si256(b04, b15, 0x20));
    _mm256_storeu_si256(o + 1, _mm256_permute2x128_si256(b26, b37, 0x20));
    _mm256_storeu_si256(o + 2, _mm256_permute2x128_si256(b04, b15, 0x31));
    _mm256_storeu_si256(o + 3, _mm256_permute2x128_si256(b26, b37, 0x31));
  }
};

// Words of blocks first .. first + 8 Groups - 1 into out[0 .. 32 Groups), in element order.
// Groups of eight blocks go through the rounds together: one group's round is a chain of
// dependent multiplies and shuffles, and a second group fills its latency (20% faster here).
// Requires the low counter word not to wrap inside them (philox_fill checks).
template <int Groups>
inline void philox_groups(uint64_t seed, uint64_t first, uint32_t* out) {
  Philox8State g[Groups];
  for (int j = 0; j < Groups; ++j) g[j] = Philox8State(first + 8 * uint64_t(j));
  const __m256i m0 = _mm256_set1_epi32(int(kPhiloxM0)), m1 = _mm256_set1_epi32(int(kPhiloxM1));
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  for (int r = 0; r < kPhiloxRounds; ++r) {
    const __m256i vk0 = _mm256_set1_epi32(int(k0)), vk1 = _mm256_set1_epi32(int(k1));
    for (int j = 0; j < Groups; ++j) g[j].round(m0, m1, vk0, vk1);
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  for (int j = 0; j < Groups; ++j) g[j].store(out + 32 * j);
}

}  // namespace detail
#endif

// out[k] = the dropout word of element start + k, for k in [0, n).
inline void philox_fill(uint64_t seed, uint64_t start, int64_t n, uint32_t* out) {
  int64_t k = 0;
  auto scalar_until = [&](int64_t end) {  // one block per four elements, as the rule says
    while (k < end) {
      const Philox4x32 block = dropout_block(seed, start + uint64_t(k));
      do {
        out[k] = block.w[(start + uint64_t(k)) & 3];
        ++k;
      } while (k < end && ((start + uint64_t(k)) & 3) != 0);
    }
  };
#if defined(__AVX2__)
  // Scalar up to a block boundary, then groups of sixteen blocks, then of eight.
  scalar_until(std::min<int64_t>(n, int64_t((4 - (start & 3)) & 3)));
  for (; k + 64 <= n; k += 64) {
    const uint64_t block = (start + uint64_t(k)) >> 2;
    if (uint32_t(block) > 0xFFFFFFF0u) break;  // low word would wrap: finish in scalar
    detail::philox_groups<2>(seed, block, out + k);
  }
  for (; k + 32 <= n; k += 32) {
    const uint64_t block = (start + uint64_t(k)) >> 2;
    if (uint32_t(block) > 0xFFFFFFF8u) break;
    detail::philox_groups<1>(seed, block, out + k);
  }
#endif
  scalar_until(n);
}

}  // namespace torchpar::kernels::cpu
