// The dropout mask rule, one definition for the CPU and CUDA kernels.
//
// Element i of the flattened (row-major, logical) tensor keeps its value iff word (i % 4)
// of philox4x32(counter = i / 4, key = seed) is below `threshold`. The rule depends only on
// the logical index, never on strides, threads or device, so CPU and CUDA draw the same
// mask from the same seed, and the backward regenerates it instead of storing it.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

#include "kernels/philox.h"

namespace torchpar::kernels {

struct DropoutRule {
  uint64_t seed = 0;
  uint64_t threshold = 0;  // keep iff word < threshold; in [0, 2^32]
  double scale = 1.0;      // 1 / (1 - p) for kept elements
  bool active = false;     // false: identity (eval mode or p == 0), no random numbers drawn

  // p in [0, 1]. The keep probability is quantised to 2^-32, far below any
  // statistical test's resolution; 32 bits per element is what curand_uniform uses too.
  static DropoutRule make(double p, bool training, uint64_t seed) {
    DropoutRule r;
    r.seed = seed;
    r.active = training && p > 0.0;
    if (!r.active) return r;
    double keep = 1.0 - p;
    r.threshold = uint64_t(std::llround(keep * 4294967296.0));
    r.scale = keep > 0.0 ? 1.0 / keep : 0.0;  // p == 1: everything dropped, scale unused
    return r;
  }
};

// Keep decision of element i, given the block of words that holds it (block i / 4).
C10_HOST_DEVICE inline bool dropout_keep(const Philox4x32& block, uint64_t i, uint64_t threshold) {
  return uint64_t(block.w[i & 3]) < threshold;
}

C10_HOST_DEVICE inline Philox4x32 dropout_block(uint64_t seed, uint64_t i) {
  return philox4x32(i >> 2, 0, seed);
}

}  // namespace torchpar::kernels
