// c10d's monitoredBarrier for torchpar: a barrier that says who is missing (issue 23).
//
// Rank 0 posts a receive from every other rank and waits for all of them until one shared
// deadline; a rank whose message has not come by then failed to reach the barrier in time.
// Then rank 0 answers every rank, which is what releases them. Messages go straight to the
// point-to-point engine, beside the collective queue (as gloo runs it on the caller's
// thread), under tags no collective (bit 63 alone) or user (bit 63 clear) ever uses.
//
// A rank that arrives after rank 0 gave up sends into a receive that no longer exists: the
// engine keeps those few bytes as an unexpected message; the group stays usable.
#include <c10/util/Exception.h>

#include <string>
#include <vector>

#include "backend/process_group.h"
#include "common/error.h"

namespace torchpar {

namespace {

constexpr uint64_t kMonitoredBarrierTag = (uint64_t{3} << 62);

std::string join_ranks(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

}  // namespace

void ProcessGroupTorchpar::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  const auto timeout = timeout_for(opts.timeout);
  const auto deadline = Clock::now() + timeout;
  const uint64_t tag = kMonitoredBarrierTag | monitored_barriers_++;
  const int rank = getRank(), size = getSize();
  P2PEngine& p2p = transport_->p2p();
  char token = 1;
  std::vector<char> tokens(size, 0);

  if (rank != 0) {
    auto sent = p2p.isend(0, tag, &token, 1, deadline);
    auto released = p2p.irecv(0, tag, &tokens[0], 1, deadline);
    try {
      sent->wait();
      released->wait();
    } catch (const Error& e) {
      // The words c10d's monitoredBarrier uses, which users and PyTorch's tests match on.
      C10_THROW_ERROR(DistBackendError,
                      "Rank " + std::to_string(rank) + " successfully reached monitoredBarrier, but received "
                          "errors while waiting for send/recv from rank 0 (group '" + group_name_ + "', " +
                          std::to_string(timeout.count()) + " ms); rank 0's error names the rank at fault: " +
                          e.what());
    }
    return;
  }

  std::vector<std::shared_ptr<Request>> arrivals(size);
  for (int r = 1; r < size; ++r) arrivals[r] = p2p.irecv(r, tag, &tokens[r], 1, deadline);
  std::vector<int> late;
  bool out_of_time = false;  // rank 0's own time ran out before it could wait for anyone
  for (int r = 1; r < size; ++r) {
    if (!wait_all_ranks && !arrivals[r]->done() && Clock::now() >= deadline) {
      out_of_time = true;
      break;
    }
    try {
      arrivals[r]->wait();
    } catch (const Error&) {
      late.push_back(r);
      if (!wait_all_ranks) break;
    }
  }
  if (!late.empty() || out_of_time) {
    // Receives not yet waited for would outlive `tokens`: withdraw them (or let them land).
    for (int r = 1; r < size; ++r) {
      if (!arrivals[r]->done() && !p2p.cancel(arrivals[r])) arrivals[r]->wait_for(timeout);
    }
    if (out_of_time) {
      C10_THROW_ERROR(DistBackendError, "[Rank 0]: Rank 0 timed out in monitoredBarrier after " +
                                            std::to_string(timeout.count()) + " ms (group '" + group_name_ + "')");
    }
    const std::string who = late.size() == 1 ? "Rank " + join_ranks(late) : "Ranks " + join_ranks(late);
    C10_THROW_ERROR(DistBackendError, "[Rank 0]: " + who + " failed to pass monitoredBarrier in " +
                                          std::to_string(timeout.count()) + " ms (group '" + group_name_ + "')");
  }
  std::vector<std::shared_ptr<Request>> releases;
  for (int r = 1; r < size; ++r) releases.push_back(p2p.isend(r, tag, &token, 1, deadline));
  for (auto& s : releases) s->wait();
}

}  // namespace torchpar
