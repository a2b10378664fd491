// Copies into memory that another core reads next (the arena). Ordinary stores leave the
// lines dirty in this core's cache, and the reader then pulls each line across cores one
// miss at a time; non-temporal stores send them to memory, which the reader streams.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace torchpar::collectives {

// Below this, the copy stays in cache and the peer's miss is cheap enough.
constexpr size_t kStreamCopyMinBytes = 256 << 10;

inline void stream_copy(void* dst, const void* src, size_t n) {
#if defined(__AVX2__)
  if (n >= kStreamCopyMinBytes) {
    auto* d = static_cast<char*>(dst);
    auto* s = static_cast<const char*>(src);
    size_t head = (32 - reinterpret_cast<uintptr_t>(d) % 32) % 32;
    std::memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
      __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
      __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
      __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
      __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
    }
    std::memcpy(d + i, s + i, n - i);
    _mm_sfence();  // the stores are visible before the step that publishes them
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

}  // namespace torchpar::collectives
