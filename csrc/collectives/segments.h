// A logical buffer made of separate contiguous pieces (the tensors of a coalesced
// all-reduce), addressed by byte offset as if the pieces lay back to back. The chunked
// algorithms stage from and reduce into it piece by piece, so the tensors are never packed
// into one flat copy and unpacked again.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

#include "collectives/stream_copy.h"

namespace torchpar::collectives {

class Segments {
 public:
  Segments() = default;
  // One contiguous buffer.
  Segments(void* data, size_t bytes) { add(data, bytes); }

  void add(void* data, size_t bytes) {
    if (bytes == 0) return;
    starts_.push_back(total_);
    ptrs_.push_back(static_cast<char*>(data));
    total_ += bytes;
  }
  size_t bytes() const { return total_; }
  // The one buffer, when there is exactly one piece; null otherwise.
  char* contiguous() const { return ptrs_.size() == 1 ? ptrs_[0] : nullptr; }

  // Calls f(ptr, at, n) for the pieces of [begin, begin + bytes): ptr is where logical byte
  // begin + at lives, and n bytes from there are contiguous.
  template <typename F>
  void for_each(size_t begin, size_t bytes, F&& f) const {
    if (bytes == 0) return;
    size_t k = std::upper_bound(starts_.begin(), starts_.end(), begin) - starts_.begin() - 1;
    for (size_t at = 0; at < bytes; ++k) {
      const size_t off = begin + at - starts_[k];
      const size_t end = k + 1 < starts_.size() ? starts_[k + 1] : total_;
      const size_t n = std::min(bytes - at, end - starts_[k] - off);
      f(ptrs_[k] + off, at, n);
      at += n;
    }
  }

  // Copies [begin, begin + bytes) into dst, with non-temporal stores where stream_copy uses
  // them (dst is read next by another core) or with memcpy.
  void gather(void* dst, size_t begin, size_t bytes, bool stream) const {
    char* d = static_cast<char*>(dst);
    for_each(begin, bytes, [&](const char* p, size_t at, size_t n) {
      if (stream) {
        stream_copy(d + at, p, n);
      } else {
        std::memcpy(d + at, p, n);
      }
    });
  }

  // Copies src into [begin, begin + bytes).
  void scatter(size_t begin, const void* src, size_t bytes) const {
    const char* s = static_cast<const char*>(src);
    for_each(begin, bytes, [&](char* p, size_t at, size_t n) { std::memcpy(p, s + at, n); });
  }

 private:
  std::vector<char*> ptrs_;
  std::vector<size_t> starts_;  // logical byte offset of each piece
  size_t total_ = 0;
};

}  // namespace torchpar::collectives
