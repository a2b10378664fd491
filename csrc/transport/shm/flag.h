// A 32-bit generation counter in shared memory that other processes can sleep on.
//
// Writers only ever move a flag forward (generations are never reset), so a waiter
// asks "has it reached g yet?" with wrap-around arithmetic and can never miss a step.
// Waiting spins briefly (a peer on another core answers within microseconds), then
// sleeps on a futex so that 4 ranks sharing 2 cores do not starve each other.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace torchpar::shm {

// True when generation `value` is at or past `target` (modulo 2^32).
inline bool reached(uint32_t value, uint32_t target) {
  return static_cast<int32_t>(value - target) >= 0;
}

// One cache line: the counter and the number of processes sleeping on it, so a writer
// makes the futex_wake system call only when somebody sleeps.
struct alignas(64) Flag {
  std::atomic<uint32_t> value{0};
  std::atomic<uint32_t> sleepers{0};

  uint32_t load() const { return value.load(std::memory_order_acquire); }

  // Publishes `v` (release: everything written before is visible to whoever sees v).
  void post(uint32_t v);
  // Adds one and wakes sleepers; returns the new value.
  uint32_t bump();
  // Wakes every sleeper without changing the value (used to deliver an abort).
  void wake_all();

  // Sleeps while the value is still `seen`, at most `max_sleep`. Spurious returns are fine.
  void sleep_while(uint32_t seen, std::chrono::microseconds max_sleep);
};

static_assert(sizeof(Flag) == 64, "a Flag owns one cache line");

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace torchpar::shm
