// The dropout mask rule, one definition for the CPU and CUDA kernels.
//
// Element i of the flattened (row-major, logical) tensor keeps its value iff its 16 random
// bits are below `threshold`: half (i % 2) (0 the low half) of word (i / 2) % 4 of
// philox4x32(counter = i / 8, key = seed). The rule depends only on the logical index, never
// on strides, threads or device, so CPU and CUDA draw the same mask from the same seed, and
// the backward regenerates it instead of storing it.
//
// Why 16 bits per element: Philox's ten rounds, not memory, bound a CPU dropout kernel, and
// sixteen bits halve them against the 32 that curand_uniform spends. The keep probability is
// then a multiple of 2^-16 (within 7.6e-6 of 1 - p), far below what training or a
// statistical test resolves; FlashAttention's fused dropout gets by with 8 bits.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

#include "kernels/philox.h"

namespace torchpar::kernels {

constexpr int kDropoutBits = 16;
constexpr uint64_t kDropoutElemsPerBlock = 4 * 32 / kDropoutBits;  // 8

struct DropoutRule {
  uint64_t seed = 0;
  uint64_t threshold = 0;  // keep iff bits < threshold; in [0, 2^16]
  double scale = 1.0;      // 1 / (1 - p) for kept elements
  bool active = false;     // false: identity (eval mode or p == 0), no random numbers drawn

  // p in [0, 1].
  static DropoutRule make(double p, bool training, uint64_t seed) {
    DropoutRule r;
    r.seed = seed;
    r.active = training && p > 0.0;
    if (!r.active) return r;
    double keep = 1.0 - p;
    r.threshold = uint64_t(std::llround(keep * double(1 << kDropoutBits)));
    r.scale = keep > 0.0 ? 1.0 / keep : 0.0;  // p == 1: everything dropped, scale unused
    return r;
  }

  // Every element kept (keep probability rounds to 1): no need to draw.
  bool keeps_all() const { return threshold >= (uint64_t(1) << kDropoutBits); }
};

// The block of Philox words that holds element i's bits.
C10_HOST_DEVICE inline Philox4x32 dropout_block(uint64_t seed, uint64_t i) {
  return philox4x32(i / kDropoutElemsPerBlock, 0, seed);
}

// The key of a mask drawn while a CUDA graph is being captured. The host cannot draw then (a
// replay would reuse that one key), so the kernel takes torch's CUDA generator's (seed, offset),
// which every replay advances on the device, and folds them into one key with SplitMix64's
// finaliser (Steele, Lea & Flood, OOPSLA'14). For a given seed the map offset -> key is a
// bijection, so every op of every replay gets a Philox stream of its own.
C10_HOST_DEVICE inline uint64_t dropout_graph_key(uint64_t seed, uint64_t offset) {
  uint64_t z = seed + (offset + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Element i's random bits, from its block.
C10_HOST_DEVICE inline uint32_t dropout_bits(const Philox4x32& block, uint64_t i) {
  return (block.w[(i >> 1) & 3] >> (kDropoutBits * (i & 1))) & 0xFFFFu;
}

C10_HOST_DEVICE inline bool dropout_keep(const Philox4x32& block, uint64_t i, uint64_t threshold) {
  return uint64_t(dropout_bits(block, i)) < threshold;
}

}  // namespace torchpar::kernels
