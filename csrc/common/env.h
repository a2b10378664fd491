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
};

}  // namespace torchpar
