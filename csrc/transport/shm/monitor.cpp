#include "transport/shm/monitor.h"

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "common/error.h"

namespace torchpar::shm {

bool process_alive(int pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  // A killed child stays a zombie until its parent reaps it, and kill() still finds it.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;  // no /proc: trust kill()
  auto close = line.rfind(')');
  return close == std::string::npos || close + 2 >= line.size() ||
         (line[close + 2] != 'Z' && line[close + 2] != 'X');
}

void Monitor::check_aborted() const {
  if (header_->abort_state.load(std::memory_order_acquire) == 0) return;
  // A failing rank is writing its reason; it takes microseconds, unless it died mid-way.
  auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
  while (header_->abort_state.load(std::memory_order_acquire) != 2) {
    if (std::chrono::steady_clock::now() > give_up) TP_THROW("the group was aborted by another rank");
    cpu_relax();
  }
  // The message is in memory every rank can write: read no further than its buffer.
  TP_THROW("the group was aborted by rank ", header_->abort_rank, ": ",
           std::string(header_->abort_msg, ::strnlen(header_->abort_msg, kAbortMessageBytes)));
}

void Monitor::check(int peer) const {
  check_aborted();
  int pid = blocks_[peer].pid;
  TP_CHECK(pid <= 0 || process_alive(pid), "rank ", name(peer), " (pid ", pid,
           ") has exited; the group cannot continue");
  TP_CHECK(blocks_[peer].left.load(std::memory_order_acquire) == 0, "rank ", name(peer),
           " has left the group (destroyed it, e.g. with destroy_process_group) before this operation "
           "completed; the group cannot continue");
}

void Monitor::leave() {
  if (blocks_ == nullptr) return;  // never mapped
  blocks_[rank_].left.store(1, std::memory_order_release);
  for (int r = 0; r < size_; ++r) {  // a peer asleep waiting for this rank checks it now
    blocks_[r].step.wake_all();
    blocks_[r].doorbell.wake_all();
  }
}

void Monitor::abort(const std::string& reason) {
  uint32_t healthy = 0;
  if (!header_->abort_state.compare_exchange_strong(healthy, 1)) return;  // first failure wins
  header_->abort_rank = name(rank_);
  size_t n = std::min(reason.size(), kAbortMessageBytes - 1);
  std::memcpy(header_->abort_msg, reason.data(), n);
  header_->abort_msg[n] = '\0';
  header_->abort_state.store(2, std::memory_order_release);
  for (int r = 0; r < size_; ++r) {
    blocks_[r].step.wake_all();
    blocks_[r].doorbell.wake_all();
  }
}

}  // namespace torchpar::shm
