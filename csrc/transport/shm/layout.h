// How a group's shared-memory segment is laid out. One segment per group:
//
//   SegmentHeader | RankBlock × world | slot × world | ring × world² (+ RingHeader each)
//
// Slots form the collective arena (rank r writes only slot r; peers read it directly).
// Ring (src, dst) carries point-to-point bytes from src to dst.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "transport/shm/flag.h"

namespace torchpar::shm {

constexpr uint64_t kMagic = 0x7470617273686d31ULL;  // "tparshm1"
constexpr size_t kAbortMessageBytes = 1024;

// What a rank is about to do in a collective; every rank compares all ranks' descriptors
// before moving data, so a mismatch is an error everywhere instead of a hang.
struct OpDesc {
  uint32_t op = 0;
  int32_t dtype = 0;
  int32_t reduce_op = 0;
  int32_t root = 0;
  uint64_t count = 0;
  uint64_t extra = 0;

  bool operator==(const OpDesc& o) const {
    return op == o.op && dtype == o.dtype && reduce_op == o.reduce_op && root == o.root &&
           count == o.count && extra == o.extra;
  }
  bool operator!=(const OpDesc& o) const { return !(*this == o); }
};

struct alignas(64) SegmentHeader {
  uint64_t magic;
  uint32_t world;
  uint32_t reserved;
  uint64_t slot_bytes;
  uint64_t ring_bytes;
  uint64_t oneshot_max_bytes;  // every rank must pick the same all-reduce algorithm
  std::atomic<uint32_t> mapped;  // ranks that have mapped the segment so far
  // Group failure: 0 = healthy, 1 = being written, 2 = published (abort_msg valid).
  std::atomic<uint32_t> abort_state;
  int32_t abort_rank;
  char abort_msg[kAbortMessageBytes];
};

struct alignas(64) RankBlock {
  Flag step;      // collective generation reached by this rank
  Flag doorbell;  // this rank's progress thread sleeps here; peers bump it
  Flag mapped;    // bumped once by the rank that created the segment, when it is unlinked
  int32_t pid;
  int32_t reserved;
  OpDesc desc;
};

struct alignas(64) RingHeader {
  std::atomic<uint64_t> head;  // bytes ever written (producer)
  char pad0[56];
  std::atomic<uint64_t> tail;  // bytes ever read (consumer)
  char pad1[56];
};

inline size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

struct Layout {
  size_t world, slot_bytes, ring_bytes;
  size_t ranks_offset, slots_offset, rings_offset, total;

  Layout(size_t world, size_t slot_bytes, size_t ring_bytes)
      : world(world), slot_bytes(align_up(slot_bytes, 4096)), ring_bytes(align_up(ring_bytes, 4096)) {
    ranks_offset = align_up(sizeof(SegmentHeader), 4096);
    slots_offset = align_up(ranks_offset + world * sizeof(RankBlock), 4096);
    rings_offset = slots_offset + world * this->slot_bytes;
    total = rings_offset + world * world * ring_stride();
  }
  size_t ring_stride() const { return align_up(sizeof(RingHeader), 4096) + ring_bytes; }
  size_t ring_offset(int src, int dst) const {
    return rings_offset + (static_cast<size_t>(src) * world + dst) * ring_stride();
  }
};

}  // namespace torchpar::shm
