#include "transport/shm/flag.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <ctime>

namespace torchpar::shm {
namespace {

// Shared (not FUTEX_PRIVATE) futexes: the word lives in memory mapped by several processes.
long futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, timeout, nullptr, 0);
}

}  // namespace

void Flag::post(uint32_t v) {
  value.store(v, std::memory_order_seq_cst);
  if (sleepers.load(std::memory_order_seq_cst) != 0) {
    futex(&value, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

uint32_t Flag::bump() {
  uint32_t v = value.fetch_add(1, std::memory_order_seq_cst) + 1;
  if (sleepers.load(std::memory_order_seq_cst) != 0) {
    futex(&value, FUTEX_WAKE, INT_MAX, nullptr);
  }
  return v;
}

void Flag::wake_all() {
  futex(&value, FUTEX_WAKE, INT_MAX, nullptr);
}

void Flag::sleep_while(uint32_t seen, std::chrono::microseconds max_sleep) {
  // Announce ourselves before the last look at the value: a writer that stores after
  // our look then sees sleepers != 0 and wakes us (both sides are seq_cst).
  sleepers.fetch_add(1, std::memory_order_seq_cst);
  if (value.load(std::memory_order_seq_cst) == seen) {
    timespec ts;
    ts.tv_sec = max_sleep.count() / 1000000;
    ts.tv_nsec = (max_sleep.count() % 1000000) * 1000;
    futex(&value, FUTEX_WAIT, seen, &ts);
  }
  sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

}  // namespace torchpar::shm
