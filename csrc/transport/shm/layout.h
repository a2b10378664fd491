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

#include "common/error.h"
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
  // 1 once this rank's side of the group is gone (destroy_process_group, the end of the job):
  // a peer still waiting for it fails at once instead of at the timeout.
  std::atomic<int32_t> left;
  OpDesc desc;
};

struct alignas(64) RingHeader {
  std::atomic<uint64_t> head;  // bytes ever written (producer)
  char pad0[56];
  std::atomic<uint64_t> tail;  // bytes ever read (consumer)
  char pad1[56];
};

inline size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// The sizes come from settings (TORCHPAR_SHM_*): every step is checked, so a huge value is
// an error here rather than a wrapped-around offset into the segment.
struct Layout {
  size_t world, slot_bytes, ring_bytes;
  size_t ranks_offset, slots_offset, rings_offset, total;

  Layout(size_t world, size_t slot_bytes, size_t ring_bytes)
      : world(world), slot_bytes(aligned(slot_bytes, "TORCHPAR_SHM_SLOT_BYTES")),
        ring_bytes(aligned(ring_bytes, "TORCHPAR_SHM_RING_BYTES")) {
    ranks_offset = align_up(sizeof(SegmentHeader), 4096);
    size_t stride = ring_stride();
    bool overflow = __builtin_mul_overflow(world, sizeof(RankBlock), &slots_offset) ||
                    __builtin_add_overflow(slots_offset, ranks_offset, &slots_offset) ||
                    slots_offset > SIZE_MAX - 4096;
    if (!overflow) slots_offset = align_up(slots_offset, 4096);
    size_t rings = 0;
    overflow = overflow || __builtin_mul_overflow(world, this->slot_bytes, &rings_offset) ||
               __builtin_add_overflow(rings_offset, slots_offset, &rings_offset) ||
               __builtin_mul_overflow(world, world, &rings) || __builtin_mul_overflow(rings, stride, &rings) ||
               __builtin_add_overflow(rings_offset, rings, &total) || total > static_cast<size_t>(INT64_MAX);
    TP_CHECK(!overflow, "a shared-memory segment for ", world, " ranks with TORCHPAR_SHM_SLOT_BYTES=", slot_bytes,
             " and TORCHPAR_SHM_RING_BYTES=", ring_bytes, " would exceed 2^63 bytes; choose smaller sizes");
  }
  size_t ring_stride() const { return align_up(sizeof(RingHeader), 4096) + ring_bytes; }
  size_t ring_offset(int src, int dst) const {
    return rings_offset + (static_cast<size_t>(src) * world + dst) * ring_stride();
  }

 private:
  // Page-aligned `bytes`, leaving room for a ring's header page on top.
  static size_t aligned(size_t bytes, const char* setting) {
    TP_CHECK(bytes <= (size_t{1} << 62), setting, "=", bytes, " is too large for a shared-memory segment");
    return align_up(bytes, 4096);
  }
};

}  // namespace torchpar::shm
