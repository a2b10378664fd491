// TORCHPAR_* environment settings, read once per group at construction.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>

namespace torchpar {

inline int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  long long parsed = std::strtoll(v, &end, 10);
  // Suffixes K/M/G so sizes read naturally: TORCHPAR_SHM_SLOT_BYTES=4M.
  if (end && (*end == 'K' || *end == 'k')) parsed <<= 10;
  if (end && (*end == 'M' || *end == 'm')) parsed <<= 20;
  if (end && (*end == 'G' || *end == 'g')) parsed <<= 30;
  return parsed;
}

inline std::string env_str(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v == nullptr || *v == '\0' ? std::string(fallback) : std::string(v);
}

// Whether `name` is set in the environment (a user's choice overrides our heuristics).
inline bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0';
}

struct Config {
  // Bytes per rank in the group's shared arena (collectives stage chunks here).
  int64_t slot_bytes = env_int("TORCHPAR_SHM_SLOT_BYTES", 4 << 20);
  // Bytes of each point-to-point ring (one per ordered pair of ranks).
  int64_t ring_bytes = env_int("TORCHPAR_SHM_RING_BYTES", 1 << 20);
  // How long a waiter spins on the CPU before yielding it between looks (0: yield at
  // once; a peer scheduled on the same core then runs without delay)...
  int64_t spin_us = env_int("TORCHPAR_SPIN_US", 0);
  // ... and how long it keeps looking between sched_yield() calls before sleeping on a
  // futex. Yielding lets a peer that shares our core run, without the wake-up latency of a
  // sleep, which on a busy machine costs ~100 us per step.
  int64_t yield_us = env_int("TORCHPAR_YIELD_US", 2000);
  // Largest all-reduce (bytes) that uses the one-shot algorithm.
  int64_t oneshot_max_bytes = env_int("TORCHPAR_ONESHOT_MAX_BYTES", 64 << 10);
  // "auto": shared memory when every rank of the group is on one host, TCP otherwise;
  // "tcp" forces sockets between every pair (as if each rank were on its own host).
  std::string transport = env_str("TORCHPAR_TRANSPORT", "auto");
  // The network interface whose IPv4 addresses ranks on other hosts connect to (default:
  // every non-loopback interface, tried in turn).
  std::string socket_ifname = env_str("TORCHPAR_SOCKET_IFNAME", "");
  // Point-to-point collectives move large buffers in pieces of this many bytes per peer,
  // so reducing one piece overlaps receiving the next.
  int64_t p2p_chunk_bytes = env_int("TORCHPAR_P2P_CHUNK_BYTES", 1 << 20);
};

}  // namespace torchpar
