// The point-to-point requests of one collective, posted to the group's engine and waited
// for together. Tags come from the collective's sequence number, so a collective's
// messages never match another's or a user's (user tags have bit 63 clear).
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#include "collectives/comm.h"
#include "transport/request.h"

namespace torchpar::collectives::p2p {

// Steps of a collective, so that messages of different steps never match each other.
enum class Phase : uint32_t { kAgree = 0, kCounts, kScatter, kGather, kTree, kDirect, kHosts };

class Exchange {
 public:
  explicit Exchange(Comm& c) : c_(c) {}
  // If the collective ends early (an exception), the buffers the pending requests name are
  // about to go away: the engine is failed and every request waited for first.
  ~Exchange();
  Exchange(const Exchange&) = delete;
  Exchange& operator=(const Exchange&) = delete;

  using Handle = std::shared_ptr<Request>;
  // `index` tells apart the messages of one phase between the same pair (chunk numbers).
  Handle send(int peer, Phase phase, uint32_t index, const void* data, size_t bytes);
  Handle recv(int peer, Phase phase, uint32_t index, void* data, size_t bytes);

  // Waits for one request; on an error the whole collective is given up (see above).
  void wait(const Handle& h);
  // Waits for every request posted so far.
  void wait_all();
  // Withdraws every request: receives no message has matched are cancelled, the rest waited
  // for. For receives posted before agree(), when it fails (so no peer will send).
  void cancel_all();

 private:
  uint64_t tag(Phase phase, uint32_t index) const;
  // Waits until every request has finished, however it ends.
  void drain();
  // Fails the engine with `error` (its pending requests with it) and drains.
  void give_up(std::exception_ptr error);
  // give_up(), then rethrows `error`.
  [[noreturn]] void abandon(std::exception_ptr error);

  Comm& c_;
  std::vector<Handle> posted_;
};

// Every rank sends its record of `bytes` (at records + rank × bytes) to every other and
// receives theirs in place: an all-gather of one small record per rank.
void share(Comm& c, Phase phase, void* records, size_t bytes);

// Every rank sends its descriptor to every other; returns once all have arrived and agree,
// or throws the same UsageError on every rank. It is also a barrier. Does nothing when
// c.agreed (the hierarchical collectives checked every rank's descriptor already). Receives posted in
// `early` beforehand (so that large messages land in place instead of in a buffer for early
// arrivals) are withdrawn if it throws.
void agree(Comm& c, const shm::OpDesc& desc, Exchange* early = nullptr);

// The number of chunks of `chunk` elements in a region of `n` (none for an empty region).
inline size_t chunks_of(size_t n, size_t chunk) { return (n + chunk - 1) / chunk; }

// Elements per chunk of a collective over `count` elements of `dtype`:
// TORCHPAR_P2P_CHUNK_BYTES in whole vectors (longer if `count` needs more than 2^19 chunks).
size_t chunk_elements(const Comm& c, c10::ScalarType dtype, size_t count);

}  // namespace torchpar::collectives::p2p
