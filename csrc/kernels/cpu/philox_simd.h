// The dropout multipliers of a run of elements (kernels/dropout.h's rule), many Philox blocks
// at a time in vector lanes: eight per AVX2 register, sixteen per AVX-512 register. Philox, not
// memory, bounds the dropout kernels on a CPU, and in lanes it runs several times faster
// than scalar. The scalar form in philox.h stays the definition: the edges of a run use it,
// and the tests check that both agree.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

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
  static constexpr int kGroups = 4;  // groups in flight (see philox_groups)
  static V set1(uint32_t x) { return _mm512_set1_epi32(int(x)); }
  static V iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static V zero() { return _mm512_setzero_si512(); }
  static V add(V a, V b) { return _mm512_add_epi32(a, b); }
  static V xor3(V a, V b, V c) { return _mm512_ternarylogic_epi32(a, b, c, 0x96); }
  // (hi, lo) halves of a * m per lane; mul_epu32 multiplies the even lanes only. A masked
  // swap of each 64-bit product's halves moves the other half into place in one step.
  static void mulhilo(V a, V m, V& hi, V& lo) {
    V even = _mm512_mul_epu32(a, m);
    V odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
    lo = _mm512_mask_shuffle_epi32(even, 0xAAAA, odd, _MM_PERM_CDAB);
    hi = _mm512_mask_shuffle_epi32(odd, 0x5555, even, _MM_PERM_CDAB);
  }
  // Lane k of c_j is word j of block k; elements want block-major order. Within each
  // 128-bit lane, unpacks gather block 4l + m into b_m; then a 4x4 transpose of 128-bit
  // lanes puts the words of blocks 4q .. 4q + 3, in order, into w[q].
  static void transpose(V c0, V c1, V c2, V c3, V (&w)[4]) {
    V t0 = _mm512_unpacklo_epi32(c0, c1), t1 = _mm512_unpackhi_epi32(c0, c1);
    V t2 = _mm512_unpacklo_epi32(c2, c3), t3 = _mm512_unpackhi_epi32(c2, c3);
    V b0 = _mm512_unpacklo_epi64(t0, t2), b1 = _mm512_unpackhi_epi64(t0, t2);
    V b2 = _mm512_unpacklo_epi64(t1, t3), b3 = _mm512_unpackhi_epi64(t1, t3);
    V u0 = _mm512_shuffle_i32x4(b0, b1, 0x44), u1 = _mm512_shuffle_i32x4(b2, b3, 0x44);
    V u2 = _mm512_shuffle_i32x4(b0, b1, 0xEE), u3 = _mm512_shuffle_i32x4(b2, b3, 0xEE);
    w[0] = _mm512_shuffle_i32x4(u0, u1, 0x88);
    w[1] = _mm512_shuffle_i32x4(u0, u1, 0xDD);
    w[2] = _mm512_shuffle_i32x4(u2, u3, 0x88);
    w[3] = _mm512_shuffle_i32x4(u2, u3, 0xDD);
  }
  static void storeu(uint32_t* p, V v) { _mm512_storeu_si512(p, v); }

  // The dropout multipliers of the 32 elements whose bits are the 16-bit halves of w, in
  // order: scale where the bits are below the threshold, else 0.
  struct Keep {
    V threshold;
    __m512 scale;
    Keep(uint32_t t, float s) : threshold(_mm512_set1_epi16(short(t))), scale(_mm512_set1_ps(s)) {}
    void store(float* out, V w) const {
      const __mmask32 kept = _mm512_cmplt_epu16_mask(w, threshold);
      _mm512_storeu_ps(out, _mm512_maskz_mov_ps(__mmask16(kept), scale));
      _mm512_storeu_ps(out + 16, _mm512_maskz_mov_ps(__mmask16(kept >> 16), scale));
    }
  };
};
#else
// Eight 32-bit lanes, one Philox block per lane.
struct Lanes {
  using V = __m256i;
  static constexpr int kBlocks = 8;
  static constexpr int kGroups = 2;
  static V set1(uint32_t x) { return _mm256_set1_epi32(int(x)); }
  static V iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static V zero() { return _mm256_setzero_si256(); }
  static V add(V a, V b) { return _mm256_add_epi32(a, b); }
  static V xor3(V a, V b, V c) { return _mm256_xor_si256(_mm256_xor_si256(a, b), c); }
  static void mulhilo(V a, V m, V& hi, V& lo) {
    V even = _mm256_mul_epu32(a, m);
    V odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
    lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
    hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  }
  // A 4x8 transpose: unpacks within 128-bit lanes, then swap the lanes' halves; w[q] holds
  // the words of blocks 2q and 2q + 1, in order.
  static void transpose(V c0, V c1, V c2, V c3, V (&w)[4]) {
    V t0 = _mm256_unpacklo_epi32(c0, c1), t1 = _mm256_unpackhi_epi32(c0, c1);
    V t2 = _mm256_unpacklo_epi32(c2, c3), t3 = _mm256_unpackhi_epi32(c2, c3);
    V b04 = _mm256_unpacklo_epi64(t0, t2), b15 = _mm256_unpackhi_epi64(t0, t2);
    V b26 = _mm256_unpacklo_epi64(t1, t3), b37 = _mm256_unpackhi_epi64(t1, t3);
    w[0] = _mm256_permute2x128_si256(b04, b15, 0x20);
    w[1] = _mm256_permute2x128_si256(b26, b37, 0x20);
    w[2] = _mm256_permute2x128_si256(b04, b15, 0x31);
    w[3] = _mm256_permute2x128_si256(b26, b37, 0x31);
  }
  static void storeu(uint32_t* p, V v) { _mm256_storeu_si256(reinterpret_cast<V*>(p), v); }

  // Keep for 16 elements. AVX2 compares signed only: flipping both sides' top bit turns it
  // into unsigned order; each 16-bit result then widens to its float's 32 bits.
  struct Keep {
    V threshold;  // top bit flipped
    __m256 scale;
    Keep(uint32_t t, float s) : threshold(_mm256_set1_epi16(short(t ^ 0x8000u))), scale(_mm256_set1_ps(s)) {}
    void store(float* out, V w) const {
      const V kept = _mm256_cmpgt_epi16(threshold, _mm256_xor_si256(w, _mm256_set1_epi16(short(0x8000))));
      const V lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(kept));
      const V hi = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(kept, 1));
      _mm256_storeu_ps(out, _mm256_and_ps(_mm256_castsi256_ps(lo), scale));
      _mm256_storeu_ps(out + 8, _mm256_and_ps(_mm256_castsi256_ps(hi), scale));
    }
  };
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
    c0 = Lanes::xor3(hi1, c1, k0);
    c1 = lo1;
    c2 = Lanes::xor3(hi0, c3, k1);
    c3 = lo0;
  }

  void transpose(V (&w)[4]) const { Lanes::transpose(c0, c1, c2, c3, w); }
};

// The words of blocks first .. first + Groups * kBlocks - 1, handed to sink(k, words) kBlocks
// words at a time, k counting words from the first block's. Groups go through the rounds
// together: one group's round is a chain of dependent multiplies and shuffles, and the other
// groups fill its latency (two groups: 20% faster than one with AVX2; four: 20% faster than two
// with AVX-512, which has the registers). Requires the low counter word not to wrap inside
// them (philox_run checks).
template <int Groups, typename Sink>
inline void philox_groups(uint64_t seed, uint64_t first, Sink& sink) {
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
  for (int j = 0; j < Groups; ++j) {
    Lanes::V w[4];
    g[j].transpose(w);
    for (int q = 0; q < 4; ++q) sink(int64_t(Lanes::kBlocks) * (4 * j + q), w[q]);
  }
}

}  // namespace detail
#endif

// The dropout bits of elements start .. start + n - 1 (dropout.h): vector_sink(k, words) for
// runs of 2 * Lanes::kBlocks elements from element start + k (two per word, low half first),
// scalar_sink(k, bits) for single ones.
template <typename VectorSink, typename ScalarSink>
inline void philox_run(uint64_t seed, uint64_t start, int64_t n, VectorSink&& vector_sink,
                       ScalarSink&& scalar_sink) {
  constexpr int64_t kPerBlock = int64_t(kDropoutElemsPerBlock);
  int64_t k = 0;
  auto scalar_until = [&](int64_t end) {
    while (k < end) {
      const Philox4x32 block = dropout_block(seed, start + uint64_t(k));
      do {
        scalar_sink(k, dropout_bits(block, start + uint64_t(k)));
        ++k;
      } while (k < end && (start + uint64_t(k)) % kPerBlock != 0);
    }
  };
#if defined(TORCHPAR_PHILOX_LANES)
  // Scalar up to a block boundary, then kGroups groups of lanes at a time, then one.
  constexpr int64_t kBlocks = detail::Lanes::kBlocks;
  constexpr int64_t kGroups = detail::Lanes::kGroups;
  scalar_until(std::min<int64_t>(n, int64_t((kPerBlock - start % kPerBlock) % kPerBlock)));
  int64_t base = 0;
  auto sink = [&](int64_t word, detail::Lanes::V w) { vector_sink(base + 2 * word, w); };
  for (; k + kPerBlock * kGroups * kBlocks <= n; k += kPerBlock * kGroups * kBlocks) {
    const uint64_t block = (start + uint64_t(k)) / kPerBlock;
    if (uint32_t(block) > uint32_t(-kGroups * kBlocks)) break;  // low word would wrap: scalar
    base = k;
    detail::philox_groups<kGroups>(seed, block, sink);
  }
  for (; k + kPerBlock * kBlocks <= n; k += kPerBlock * kBlocks) {
    const uint64_t block = (start + uint64_t(k)) / kPerBlock;
    if (uint32_t(block) > uint32_t(-kBlocks)) break;
    base = k;
    detail::philox_groups<1>(seed, block, sink);
  }
#endif
  scalar_until(n);
}

// mult[k] = rule.scale if element start + k is kept, else 0, for k in [0, n).
template <typename acc_t>
inline void dropout_multipliers(const DropoutRule& rule, uint64_t start, int64_t n, acc_t* mult) {
  const acc_t scale = acc_t(rule.scale);
  if (rule.keeps_all()) {
    std::fill(mult, mult + n, scale);
    return;
  }
  const uint32_t t = uint32_t(rule.threshold);
  auto scalar = [&](int64_t k, uint32_t bits) { mult[k] = bits < t ? scale : acc_t(0); };
#if defined(TORCHPAR_PHILOX_LANES)
  using detail::Lanes;
  if constexpr (std::is_same_v<acc_t, float>) {
    const Lanes::Keep keep(t, scale);
    philox_run(rule.seed, start, n, [&](int64_t k, Lanes::V w) { keep.store(mult + k, w); }, scalar);
  } else {
    philox_run(rule.seed, start, n, [&](int64_t k, Lanes::V w) {
      uint16_t bits[2 * Lanes::kBlocks];
      Lanes::storeu(reinterpret_cast<uint32_t*>(bits), w);
      for (int j = 0; j < 2 * Lanes::kBlocks; ++j) scalar(k + j, bits[j]);
    }, scalar);
  }
#else
  philox_run(rule.seed, start, n, [](int64_t, uint32_t) {}, scalar);
#endif
}

}  // namespace torchpar::kernels::cpu::CPU_CAPABILITY
