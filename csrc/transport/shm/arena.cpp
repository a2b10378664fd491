#include "transport/shm/arena.h"

#include <sched.h>

#include <algorithm>

#include "common/error.h"

namespace torchpar::shm {
namespace {

// A healthy peer wakes us by posting; these bounds only pace the health checks.
constexpr auto kMaxSleep = std::chrono::milliseconds(20);
constexpr auto kLivenessPeriod = std::chrono::milliseconds(100);

}  // namespace

uint32_t Arena::arrive() {
  blocks_[rank_].step.post(++step_);
  return step_;
}

void Arena::wait_peer(int peer, uint32_t target, Clock::time_point deadline, bool busy) const {
  // A peer may have published the step and then failed the group; never run on past an abort.
  monitor_->check_aborted();
  Flag& flag = blocks_[peer].step;
  if (reached(flag.load(), target)) return;
  auto start = Clock::now();
  const auto spin = busy ? spin_ : std::chrono::microseconds(0);
  const auto yield = busy ? yield_ : std::chrono::microseconds(0);
  while (Clock::now() - start < spin) {
    for (int i = 0; i < 64; ++i) {
      if (reached(flag.load(), target)) return;
      cpu_relax();
    }
  }
  while (Clock::now() - start < spin + yield && Clock::now() < deadline) {
    sched_yield();
    if (reached(flag.load(), target)) return;
    monitor_->check_aborted();
  }
  auto last_check = Clock::time_point{};
  while (true) {
    uint32_t seen = flag.load();
    if (reached(seen, target)) return;
    auto now = Clock::now();
    monitor_->check_aborted();
    if (now - last_check >= kLivenessPeriod) {
      try {
        monitor_->check(peer);
      } catch (const Error&) {
        // `seen` was read before the peer's pid: a peer that reached the step and then exited
        // (it finished the collective and left, as every rank does at the end of a job) did
        // not fail it. Seen once in a full test run: rank 0's broadcast failed naming a rank
        // that had completed it.
        if (reached(flag.load(), target)) return;
        throw;
      }
      last_check = now;
    }
    if (now >= deadline) {
      TP_THROW_TIMEOUT("timed out waiting for rank ", monitor_->name(peer), " (it is at step ", seen,
                       ", this rank waits for step ", target, ")");
    }
    auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - now);
    flag.sleep_while(
        seen, std::min<std::chrono::microseconds>(left, kMaxSleep));
  }
}

void Arena::wait_all(uint32_t target, Clock::time_point deadline, bool busy) const {
  for (int peer = 0; peer < size_; ++peer) {
    if (peer != rank_) wait_peer(peer, target, deadline, busy);
  }
}

}  // namespace torchpar::shm
