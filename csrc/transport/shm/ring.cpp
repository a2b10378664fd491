#include "transport/shm/ring.h"

#include <algorithm>
#include <cstring>

#include "common/error.h"

namespace torchpar::shm {

// Both counters live in memory another process writes. Whatever they say, a copy stays
// inside the ring: bytes in flight (head - tail) can never exceed its capacity.
size_t Ring::in_flight(uint64_t head, uint64_t tail) const {
  uint64_t used = head - tail;
  TP_CHECK(used <= capacity_, "corrupt shared-memory ring: head ", head, " and tail ", tail,
           " put more bytes in flight than its capacity of ", capacity_);
  return static_cast<size_t>(used);
}

size_t Ring::write_some(const void* src, size_t n) {
  uint64_t head = header_->head.load(std::memory_order_relaxed);
  uint64_t tail = header_->tail.load(std::memory_order_acquire);
  size_t room = capacity_ - in_flight(head, tail);
  n = std::min(n, room);
  if (n == 0) return 0;
  size_t at = static_cast<size_t>(head % capacity_);
  size_t first = std::min(n, capacity_ - at);
  std::memcpy(data_ + at, src, first);
  std::memcpy(data_, static_cast<const char*>(src) + first, n - first);
  header_->head.store(head + n, std::memory_order_release);
  return n;
}

size_t Ring::read_some(void* dst, size_t n) {
  uint64_t tail = header_->tail.load(std::memory_order_relaxed);
  uint64_t head = header_->head.load(std::memory_order_acquire);
  n = std::min(n, in_flight(head, tail));
  if (n == 0) return 0;
  size_t at = static_cast<size_t>(tail % capacity_);
  size_t first = std::min(n, capacity_ - at);
  std::memcpy(dst, data_ + at, first);
  std::memcpy(static_cast<char*>(dst) + first, data_, n - first);
  header_->tail.store(tail + n, std::memory_order_release);
  return n;
}

}  // namespace torchpar::shm
