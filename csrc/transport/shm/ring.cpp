#include "transport/shm/ring.h"

#include <algorithm>
#include <cstring>

namespace torchpar::shm {

size_t Ring::write_some(const void* src, size_t n) {
  uint64_t head = header_->head.load(std::memory_order_relaxed);
  uint64_t tail = header_->tail.load(std::memory_order_acquire);
  size_t room = capacity_ - static_cast<size_t>(head - tail);
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
  n = std::min(n, static_cast<size_t>(head - tail));
  if (n == 0) return 0;
  size_t at = static_cast<size_t>(tail % capacity_);
  size_t first = std::min(n, capacity_ - at);
  std::memcpy(dst, data_ + at, first);
  std::memcpy(static_cast<char*>(dst) + first, data_, n - first);
  header_->tail.store(tail + n, std::memory_order_release);
  return n;
}

}  // namespace torchpar::shm
