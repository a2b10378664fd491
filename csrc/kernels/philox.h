// Philox4x32-10: a counter-based random generator (Salmon et al., "Parallel Random Numbers:
// As Easy as 1, 2, 3", SC'11). Its output is a pure function of (key, counter), so any
// thread on any device can draw the numbers of element i without shared state. That is what
// lets the CPU and CUDA dropout kernels, and a forward and its backward, agree on a mask
// bit for bit. Shared by the CPU and CUDA kernels, hence C10_HOST_DEVICE.
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>

namespace torchpar::kernels {

struct Philox4x32 {
  uint32_t w[4];
};

// Round multipliers and key increments from the paper (Table 2 and section 4.2).
constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;  // golden ratio
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;  // sqrt(3) - 1
constexpr int kPhiloxRounds = 10;

// One Philox4x32 block: four 32-bit words for the 128-bit counter `ctr`, 64-bit `key`.
C10_HOST_DEVICE inline Philox4x32 philox4x32(uint64_t ctr_lo, uint64_t ctr_hi, uint64_t key) {
  uint32_t c0 = uint32_t(ctr_lo), c1 = uint32_t(ctr_lo >> 32);
  uint32_t c2 = uint32_t(ctr_hi), c3 = uint32_t(ctr_hi >> 32);
  uint32_t k0 = uint32_t(key), k1 = uint32_t(key >> 32);
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int r = 0; r < kPhiloxRounds; ++r) {
    uint64_t p0 = uint64_t(kPhiloxM0) * c0;
    uint64_t p1 = uint64_t(kPhiloxM1) * c2;
    uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0;
    uint32_t n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
    c0 = n0;
    c1 = uint32_t(p1);
    c2 = n2;
    c3 = uint32_t(p0);
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  return Philox4x32{{c0, c1, c2, c3}};
}

}  // namespace torchpar::kernels
