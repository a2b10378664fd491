#include "transport/mixed_transport.h"

#include <sched.h>

#include <algorithm>
#include <utility>

#include "common/error.h"
#include "transport/prefixed_rendezvous.h"

namespace torchpar {
namespace {

// The doorbell watcher's longest sleep: a ring wakes it at once; this only bounds how late
// it notices stop.
constexpr auto kWatchPeriod = std::chrono::milliseconds(50);

// The engine's spin and yield before it sleeps, as over shared memory (shm_transport.cpp):
// worth it only while this host has a core for each of its ranks.
std::pair<std::chrono::microseconds, std::chrono::microseconds> engine_waits(const Config& config, int local_ranks) {
  cpu_set_t set;
  CPU_ZERO(&set);
  int cpus = ::sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  int64_t spin = config.spin_us, yield = config.yield_us;
  if (local_ranks > cpus || local_ranks < 2) {
    if (!env_set("TORCHPAR_SPIN_US")) spin = std::min<int64_t>(spin, 2);
    if (!env_set("TORCHPAR_YIELD_US")) yield = 0;
  }
  return {std::chrono::microseconds(spin), std::chrono::microseconds(yield)};
}

}  // namespace

MixedTransport::MixedTransport(int rank, int size, Rendezvous& rendezvous, const Config& config,
                               std::chrono::milliseconds timeout, HostMap hosts, bool hierarchical)
    : rank_(rank), size_(size), hierarchical_(hierarchical) {
  TP_CHECK(static_cast<int>(hosts.host_of.size()) == size && hosts.hosts() >= 2, "a mixed transport needs a host for each of ",
           size, " ranks, on at least two hosts");
  hierarchy_.map = std::move(hosts);
  hierarchy_.rank = rank;
  const int host = hierarchy_.host();
  const int local_ranks = static_cast<int>(hierarchy_.local_ranks().size());
  // The hierarchical collectives share every rank's call descriptor through the leader's slot.
  TP_CHECK(config.slot_bytes >= static_cast<int64_t>(size) * static_cast<int64_t>(sizeof(shm::OpDesc)),
           "TORCHPAR_SHM_SLOT_BYTES (", config.slot_bytes, ") is too small for a group of ", size,
           " ranks across hosts: it needs ", size * sizeof(shm::OpDesc), " bytes");
  // Shared memory first, then TCP: every rank sets up in that order, and a host's segment
  // waits only for that host's ranks.
  if (local_ranks > 1) {
    PrefixedRendezvous host_keys(rendezvous, "torchpar/host" + std::to_string(host) + "/");
    shm_ = std::make_unique<shm::ShmTransport>(hierarchy_.local_rank(), local_ranks, host_keys, config, timeout,
                                               /*own_engine=*/false, hierarchy_.local_ranks());
    hierarchy_.arena = shm_->arena();
  }
  std::vector<char> remote(size);
  for (int peer = 0; peer < size; ++peer) remote[peer] = peer != rank && !hierarchy_.map.same_host(peer, rank);
  tcp_ = std::make_unique<tcp::TcpTransport>(rank, size, rendezvous, config, timeout, std::move(remote),
                                             /*own_engine=*/false);
  if (shm_) watcher_ = std::thread([this] { watch_doorbell(); });
  auto [spin, yield] = engine_waits(config, local_ranks);
  engine_ = std::make_unique<P2PEngine>(rank, size, *this, spin, yield,
                                        static_cast<size_t>(config.unexpected_max_bytes));
  published_.store(engine_.get(), std::memory_order_release);
}

MixedTransport::~MixedTransport() {
  if (engine_) engine_->stop();
  stop_.store(true);
  if (watcher_.joinable()) {
    shm_->notify(local_index(rank_));
    watcher_.join();
  }
}

void MixedTransport::watch_doorbell() {
  // Every change of the doorbell is followed by a ring of the eventfd made after it, so a
  // poll() that began before the change returns: the value rung is re-read after each ring.
  uint32_t rung = shm_->activity();
  while (!stop_.load(std::memory_order_acquire)) {
    shm_->sleep_until_activity(rung, kWatchPeriod);
    const uint32_t now = shm_->activity();
    if (now != rung) {
      tcp_->notify(rank_);
      rung = now;
    }
  }
}

size_t MixedTransport::write_some(int peer, const void* data, size_t n) {
  return local(peer) ? shm_->write_some(local_index(peer), data, n) : tcp_->write_some(peer, data, n);
}

size_t MixedTransport::read_some(int peer, void* data, size_t n) {
  return local(peer) ? shm_->read_some(local_index(peer), data, n) : tcp_->read_some(peer, data, n);
}

void MixedTransport::notify(int peer) {
  if (peer == rank_) {
    tcp_->notify(rank_);  // a post on this rank: wakes the engine's poll()
  } else if (local(peer)) {
    shm_->notify(local_index(peer));
  }  // bytes in a socket wake a remote peer by themselves
}

uint32_t MixedTransport::activity() const {
  // Either counter moving is activity; their sum moves whenever one does.
  return tcp_->activity() + (shm_ ? shm_->activity() : 0u);
}

void MixedTransport::sleep_until_activity(uint32_t seen, std::chrono::microseconds max_sleep) {
  if (activity() != seen) return;
  // A doorbell rung from here on rings the eventfd too (watch_doorbell), which ends the poll.
  tcp_->sleep_until_activity(tcp_->activity(), max_sleep);
}

void MixedTransport::check_peer(int peer) {
  // Either side may carry the news of the group's failure: a rank of this host publishes it
  // in the segment, a rank elsewhere in the store and by closing its sockets.
  if (shm_) shm_->monitor().check_aborted();
  tcp_->check_peer(peer);
  if (local(peer)) shm_->check_peer(local_index(peer));
}

void MixedTransport::leave() {
  if (shm_) shm_->leave();  // this host's peers
  tcp_->leave();            // the others'
}

void MixedTransport::abort(const std::string& reason) {
  // This host's ranks stop at once through the segment; the other hosts' when this rank's
  // sockets close (and they read the reason in the store).
  if (shm_) shm_->abort(reason);
  tcp_->abort(reason);
  if (auto* engine = published_.load(std::memory_order_acquire)) engine->fail(std::make_exception_ptr(Error(reason)));
}

}  // namespace torchpar
