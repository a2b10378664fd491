// What a collective algorithm runs over: the group's point-to-point engine, the arena
// when the ranks share memory (direct access to every rank's slot, generation-counter
// barriers), and the deadline of the operation. Algorithms never touch segments, rings or
// sockets.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/env.h"
#include "transport/hosts.h"
#include "transport/p2p_engine.h"
#include "transport/shm/arena.h"

namespace torchpar::collectives {

// Identifies the collective in the descriptor every rank publishes before moving data.
enum class OpKind : uint32_t {
  kAllreduce = 1, kBroadcast, kReduce, kAllgather, kGather, kScatter, kReduceScatter,
  kAlltoall, kBarrier,
};

const char* name(OpKind kind);

struct Comm {
  shm::Arena* shared;  // null: no shared memory (ranks on several hosts); see p2p/
  P2PEngine& p2p;
  const Config& config;
  Clock::time_point deadline;
  uint64_t seq;  // this collective's number in the group (named in error messages)
  // Busy-wait (spin, then yield) for peers: right when the caller blocks on the result;
  // wrong when it runs asynchronously beside the caller's computation, whose CPU it steals.
  bool busy_wait = true;
  // Staging memory of the point-to-point algorithms, kept by the group between collectives:
  // allocating and faulting in tens of MiB on every call costs more than moving them.
  std::vector<char>* scratch = nullptr;
  // A group spanning hosts: which ranks share a host, and this host's arena; all_reduce and
  // broadcast then run hierarchically (hierarchical.h). Null: flat algorithms.
  const Hierarchy* hierarchy = nullptr;
  // A sub-communicator of the group: the algorithms see ranks 0..members->size()-1, this
  // rank being `member_rank`, and reach member q as the group's rank (*members)[q]. Null:
  // the whole group. (The hierarchical collectives run the flat ones among hosts' leaders.)
  const std::vector<int>* members = nullptr;
  int member_rank = 0;
  // The descriptors were already checked across the whole group (p2p agree() is skipped).
  bool agreed = false;

  int rank() const { return members ? member_rank : p2p.rank(); }
  int size() const { return members ? static_cast<int>(members->size()) : p2p.size(); }
  // The group's rank (the engine's peer number) of member q.
  int peer(int q) const { return members ? (*members)[q] : q; }
  shm::Arena& arena() const { return *shared; }
  // The first `bytes` of *scratch (grown when needed; its contents are not kept).
  char* staging(size_t bytes);

  // Waits until every peer has finished reading this rank's slot, then publishes `desc`.
  void begin(const shm::OpDesc& desc);
  // Waits until every peer has finished reading this rank's slot.
  void wait_slot_free();
  // arrive(): publish the next step. arrive_and_wait(): ... and wait for every peer to reach it.
  uint32_t arrive() { return arena().arrive(); }
  void arrive_and_wait() { arena().wait_all(arena().arrive(), deadline, busy_wait); }
  void wait_for(int peer) { arena().wait_peer(peer, arena().step(), deadline, busy_wait); }
  // After the first arrive_and_wait of a collective: checks that every rank published the
  // same descriptor. On a mismatch every rank throws the same error, in step.
  void check_descriptors();
};

size_t element_size(c10::ScalarType dtype);

// "" when every rank published the same descriptor (descs[r] is rank r's); otherwise the
// message every rank throws, naming what each rank called.
std::string mismatch(const std::vector<shm::OpDesc>& descs, uint64_t seq);

// The descriptor of a collective call, as every rank publishes it before moving data.
shm::OpDesc op_desc(OpKind kind, c10::ScalarType dtype, uint64_t count, int root = 0, int reduce_op = 0);

// The piece [begin, end) of `count` elements that rank `r` of `world` owns when work is
// split across ranks; pieces are multiples of 16 elements (whole vectors) except the last.
struct Piece {
  size_t begin, end;
  size_t size() const { return end - begin; }
};
Piece piece_of(size_t count, int world, int r);

}  // namespace torchpar::collectives
