// TORCHPAR_* environment settings, read once per group at construction.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include "common/error.h"

namespace torchpar {

// A whole decimal number with an optional K/M/G suffix (TORCHPAR_SHM_SLOT_BYTES=4M); false
// for anything else (a sign, hex, trailing text) or a value that does not fit in int64_t.
inline bool parse_size(const std::string& text, int64_t* out) {
  if (text.empty()) return false;
  size_t digits = 0;
  int64_t value = 0;
  for (; digits < text.size() && text[digits] >= '0' && text[digits] <= '9'; ++digits) {
    if (__builtin_mul_overflow(value, 10, &value) || __builtin_add_overflow(value, text[digits] - '0', &value)) {
      return false;
    }
  }
  if (digits == 0 || text.size() - digits > 1) return false;
  int shift = 0;
  if (digits < text.size()) {
    switch (text[digits]) {
      case 'K': case 'k': shift = 10; break;
      case 'M': case 'm': shift = 20; break;
      case 'G': case 'g': shift = 30; break;
      default: return false;
    }
  }
  if (value > (INT64_MAX >> shift)) return false;
  *out = value << shift;
  return true;
}

// Settings are read when a group is created: a value that is not a size is an error naming
// the setting, never a silent 0 or a wrapped-around shift.
inline int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  int64_t parsed = 0;
  if (!parse_size(v, &parsed)) {
    throw Error(detail::message(__FILE__, __LINE__, name, "='", v,
                                "' is not a size: expected digits with an optional K, M or G suffix, below 2^63"));
  }
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

// The default bound on early arrivals: half of the memory this process may use (the
// machine's, or the cgroup's limit where one is set). A fixed bound such as 1 GiB refused
// collectives that worked before it existed: a broadcast or all-gather of more than that to
// a rank still computing arrives ahead of its receives. Past half of memory the process
// would be near an out-of-memory kill anyway, and failing names the sender and sizes.
inline int64_t default_unexpected_max_bytes() {
  int64_t memory = static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(::sysconf(_SC_PAGE_SIZE));
  std::ifstream cgroup("/sys/fs/cgroup/memory.max");  // cgroup v2; "max" when unlimited
  std::string limit;
  int64_t parsed = 0;
  if (cgroup >> limit && parse_size(limit, &parsed) && parsed > 0) memory = memory > 0 ? std::min(memory, parsed) : parsed;
  return memory > 0 ? memory / 2 : int64_t{1} << 30;
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
  // Most bytes of messages that arrived before their receive was posted that a rank holds
  // at once (see P2PEngine::on_header for why exceeding it fails the group).
  int64_t unexpected_max_bytes = env_int("TORCHPAR_UNEXPECTED_MAX_BYTES", default_unexpected_max_bytes());
};

}  // namespace torchpar
