// The dropout words of a run of elements (kernels/dropout.h's rule), many Philox blocks at a
// time in vector lanes: eight per AVX2 register, sixteen per AVX-512 register. Philox, not
// memory, bounds the dropout kernels on a CPU, and in lanes it runs several times faster
// than scalar. The scalar form in philox.h stays the definition: the edges of a run use it,
// and the tests check that both agree.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/dropout.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#define TORCHPAR_PHILOX_LANES 1
#endif

// In the instruction set's own namespace: each copy of the kernels gets its own (kernels.h).
namespace torchpar::kernels::cpu::CPU_CAPABILITY {

#if defined(TORCHPAR_PHILOX_LANES)
namespace detail {

#if defined(CPU_CAPABILITY_AVX512)
// Sixteen 32-bit lanes, one Philox block per lane.
struct Lanes {
  using V = __m512i;
  static constexpr int kBlocks = 16;
  static V set1(uint32_t x) { return _mm512_set1_epi32(int(x)); }
  static V iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static V zero() { return _mm512_setzero_si512(); }
  static V add(V a, V b) { return _mm512_add_epi32(a, b); }
  static V xor_(V a, V b) { return _mm512_xor_si512(a, b); }
  // (hi, lo) halves of a * m per lane; mul_epu32 multiplies the even lanes only.
  static void mulhilo(V a, V m, V& hi, V& lo) {
    V even = _mm512_mul_epu32(a, m);
    V odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
    lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
    hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
  }
  // Lane k of c_j is word j of block k; memory wants block-major order. Within each
  // 128-bit lane, unpacks gather block 4l + m into b_m; then a 4x4 transpose of 128-bit
  // lanes puts blocks 4q .. 4q + 3 into output vector q.
  static void store(V c0, V c1, V c2, V c3, uint32_t* out) {
    V t0 = _mm512_unpacklo_epi32(c0, c1), t1 = _mm512_unpackhi_epi32(c0, c1);
    V t2 = _mm512_unpacklo_epi32(c2, c3), t3 = _mm512_unpackhi_epi32(c2, c3);
    V b0 = _mm512_unpacklo_epi64(t0, t2), b1 = _mm512_unpackhi_epi64(t0, t2);
    V b2 = _mm512_unpacklo_epi64(t1, t3), b3 = _mm512_unpackhi_epi64(t1, t3);
    V u0 = _mm512_shuffle_i32x4(b0, b1, 0x44), u1 = _mm512_shuffle_i32x4(b2, b3, 0x44);
    V u2 = _mm512_shuffle_i32x4(b0, b1, 0xEE), u3 = _mm512_shuffle_i32x4(b2, b3, 0xEE);
    _mm512_storeu_si512(out + 0, _mm512_shuffle_i32x4(u0, u1, 0x88));
    _mm512_storeu_si512(out + 16, _mm512_shuffle_i32x4(u0, u1, 0xDD));
    _mm512_storeu_si512(out + 32, _mm512_shuffle_i32x4(u2, u3, 0x88));
    _mm512_storeu_si512(out + 48, _mm512_shuffle_i32x4(u2, u3, 0xDD));
  }
};
#else
// Eight 32-bit lanes, one Philox block per lane.
struct Lanes {
  using V = __m256i;
  static constexpr int kBlocks = 8;
  static V set1(uint32_t x) { return _mm256_set1_epi32(int(x)); }
  static V iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static V zero() { return _mm256_setzero_si256(); }
  static V add(V a, V b) { return _mm256_add_epi32(a, b); }
  static V xor_(V a, V b) { return _mm256_xor_si256(a, b); }
  static void mulhilo(V a, V m, V& hi, V& lo) {
    V even = _mm256_mul_epu32(a, m);
    V odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
    lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
    hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  }
  // A 4x8 transpose: unpacks within 128-bit lanes, then swap the lanes' halves.
  static void store(V c0, V c1, V c2, V c3, uint32_t* out) {
    V t0 = _mm256_unpacklo_epi32(c0, c1), t1 = _mm256_unpackhi_epi32(c0, c1);
    V t2 = _mm256_unpacklo_epi32(c2, c3), t3 = _mm256_unpackhi_epi32(c2, c3);
    V b04 = _mm256_unpacklo_epi64(t0, t2), b15 = _mm256_unpackhi_epi64(t0, t2);
    V b26 = _mm256_unpacklo_epi64(t1, t3), b37 = _mm256_unpackhi_epi64(t1, t3);
    auto* o = reinterpret_cast<V*>(out);
    _mm256_storeu_si256(o + 0, _mm256_permute2x128_si256(b04, b15, 0x20));
    _mm256_storeu_si256(o + 1, _mm256_permute2x128_si256(b26, b37, 0x20));
    _mm256_storeu_si256(o + 2, _mm256_permute2x128_si256(b04, b15, 0x31));
    _mm256_storeu_si256(o + 3, _mm256_permute2x128_si256(b26, b37, 0x31));
  }
};
#endif

// Word j of Lanes::kBlocks consecutive blocks' counters, then of their outputs.
struct PhiloxLanes {
  using V = Lanes::V;
  V c0, c1, c2, c3;

  PhiloxLanes() = default;
  // Counters built in registers: writing them to memory as scalars and reloading them as one
  // vector stalls on store-to-load forwarding, which cost more than the ten rounds.
  explicit PhiloxLanes(uint64_t first)
      : c0(Lanes::add(Lanes::set1(uint32_t(first)), Lanes::iota())),
        c1(Lanes::set1(uint32_t(first >> 32))),
        c2(Lanes::zero()),
        c3(Lanes::zero()) {}

  void round(V m0, V m1, V k0, V k1) {
    V hi0, lo0, hi1, lo1;
    Lanes::mulhilo(c0, m0, hi0, lo0);
    Lanes::mulhilo(c2, m1, hi1, lo1);
    c0 = Lanes::xor_(Lanes::xor_(hi1, c1), k0);
    c1 = lo1;
    c2 = Lanes::xor_(Lanes::xor_(hi0, c3), k1);
    c3 = lo0;
  }

  void store(uint32_t* out) const { Lanes::store(c0, c1, c2, c3, out); }
};

// Words of blocks first .. first + Groups * kBlocks - 1 into out, in element order. Groups go
// through the rounds together: one group's round is a chain of dependent multiplies and
// shuffles, and a second group fills its latency (20% faster here). Requires the low counter
// word not to wrap inside them (philox_fill checks).
template <int Groups>
inline void philox_groups(uint64_t seed, uint64_t first, uint32_t* out) {
  PhiloxLanes g[Groups];
  for (int j = 0; j < Groups; ++j) g[j] = PhiloxLanes(first + uint64_t(Lanes::kBlocks) * j);
  const auto m0 = Lanes::set1(kPhiloxM0), m1 = Lanes::set1(kPhiloxM1);
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  for (int r = 0; r < kPhiloxRounds; ++r) {
    const auto vk0 = Lanes::set1(k0), vk1 = Lanes::set1(k1);
    for (int j = 0; j < Groups; ++j) g[j].round(m0, m1, vk0, vk1);
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  for (int j = 0; j < Groups; ++j) g[j].store(out + 4 * Lanes::kBlocks * j);
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
#if defined(TORCHPAR_PHILOX_LANES)
  // Scalar up to a block boundary, then two groups of lanes at a time, then one.
  constexpr int64_t kBlocks = detail::Lanes::kBlocks;
  scalar_until(std::min<int64_t>(n, int64_t((4 - (start & 3)) & 3)));
  for (; k + 8 * kBlocks <= n; k += 8 * kBlocks) {
    const uint64_t block = (start + uint64_t(k)) >> 2;
    if (uint32_t(block) > uint32_t(-2 * kBlocks)) break;  // low word would wrap: scalar
    detail::philox_groups<2>(seed, block, out + k);
  }
  for (; k + 4 * kBlocks <= n; k += 4 * kBlocks) {
    const uint64_t block = (start + uint64_t(k)) >> 2;
    if (uint32_t(block) > uint32_t(-kBlocks)) break;
    detail::philox_groups<1>(seed, block, out + k);
  }
#endif
  scalar_until(n);
}

}  // namespace torchpar::kernels::cpu::CPU_CAPABILITY
