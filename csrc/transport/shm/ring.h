// A single-producer single-consumer byte ring in shared memory. Head and tail only grow,
// so "full" and "empty" need no extra flag, and a message may be far larger than the
// ring: the sender streams it through in pieces while the receiver drains.
#pragma once

#include <cstddef>
#include <cstdint>

#include "transport/shm/layout.h"

namespace torchpar::shm {

class Ring {
 public:
  Ring() = default;
  Ring(RingHeader* header, char* data, size_t capacity)
      : header_(header), data_(data), capacity_(capacity) {}

  // Copies up to n bytes in; returns how many fit (0 when full). Producer only.
  size_t write_some(const void* src, size_t n);
  // Copies up to n bytes out; returns how many were there. Consumer only.
  size_t read_some(void* dst, size_t n);
  // Both throw torchpar::Error if the counters are inconsistent (a corrupt segment).

 private:
  size_t in_flight(uint64_t head, uint64_t tail) const;

  RingHeader* header_ = nullptr;
  char* data_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace torchpar::shm
