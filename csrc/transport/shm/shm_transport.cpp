#include "transport/shm/shm_transport.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>

#include <random>
#include <sstream>
#include <thread>

#include "common/error.h"
#include "transport/store_keys.h"

namespace torchpar::shm {
namespace {

std::string unique_segment_name() {
  std::random_device rd;
  std::ostringstream os;
  os << "/torchpar-" << ::getpid() << "-" << std::hex << rd() << rd();
  return os.str();
}

// With more ranks than cores, a waiting rank holds the core that the rank it waits for
// needs: spinning or yielding only delays it. Sleep on the futex at once instead (unless
// the user chose the spin and yield times).
Config adapt_to_cores(Config config, int ranks) {
  cpu_set_t set;
  CPU_ZERO(&set);
  int cpus = ::sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  if (ranks > cpus) {
    if (!env_set("TORCHPAR_SPIN_US")) config.spin_us = std::min<int64_t>(config.spin_us, 2);
    if (!env_set("TORCHPAR_YIELD_US")) config.yield_us = 0;
  }
  return config;
}

}  // namespace

ShmTransport::ShmTransport(int rank, int size, Rendezvous& rendezvous, const Config& config,
                           std::chrono::milliseconds timeout, bool own_engine, std::vector<int> group_ranks)
    : rank_(rank), size_(size) {
  Config tuned = adapt_to_cores(config, size);
  map_segment(rendezvous, tuned, timeout, std::move(group_ranks));
  if (!own_engine) return;
  p2p_ = std::make_unique<P2PEngine>(rank_, size_, *this, std::chrono::microseconds(tuned.spin_us),
                                     std::chrono::microseconds(tuned.yield_us),
                                     static_cast<size_t>(tuned.unexpected_max_bytes));
  engine_.store(p2p_.get(), std::memory_order_release);
}

ShmTransport::~ShmTransport() {
  if (p2p_) p2p_->stop();
  leave();  // (ProcessGroupTorchpar::shutdown did already, unless this transport is another's part)
}

P2PEngine& ShmTransport::p2p() {
  TP_CHECK(p2p_ != nullptr, "this shared-memory transport is driven by another transport's engine");
  return *p2p_;
}

void ShmTransport::map_segment(Rendezvous& rendezvous, const Config& config,
                               std::chrono::milliseconds timeout, std::vector<int> group_ranks) {
  TP_CHECK(config.slot_bytes > 0 && config.ring_bytes > 0, "TORCHPAR_SHM_SLOT_BYTES (", config.slot_bytes,
           ") and TORCHPAR_SHM_RING_BYTES (", config.ring_bytes, ") must be positive");
  Layout layout(size_, config.slot_bytes, config.ring_bytes);
  // Collectives split a slot into a piece (of at least one vector) per rank, and all_to_all
  // puts 2W+1 counts at its head.
  TP_CHECK(layout.slot_bytes >= static_cast<size_t>(size_) * 64 &&
               layout.slot_bytes >= (2 * static_cast<size_t>(size_) + 1) * sizeof(uint64_t),
           "TORCHPAR_SHM_SLOT_BYTES (", config.slot_bytes, ") is too small for ", size_, " ranks");
  if (rank_ == 0) {
    segment_ = Segment::create(unique_segment_name(), layout.total);
    header_ = reinterpret_cast<SegmentHeader*>(segment_.data());
    header_->world = size_;
    header_->slot_bytes = layout.slot_bytes;
    header_->ring_bytes = layout.ring_bytes;
    header_->oneshot_max_bytes = static_cast<uint64_t>(config.oneshot_max_bytes);
    header_->magic = kMagic;
    rendezvous.set(store_keys::kShmSegment, segment_.name());
  } else {
    segment_ = Segment::open(rendezvous.get(store_keys::kShmSegment));
    header_ = reinterpret_cast<SegmentHeader*>(segment_.data());
    TP_CHECK(segment_.size() >= layout.total && header_->magic == kMagic &&
                 header_->world == static_cast<uint32_t>(size_),
             "shared-memory segment ", segment_.name(), " does not match this group (world ",
             size_, "); do all ranks run the same torchpar version and TORCHPAR_SHM_* settings?");
    TP_CHECK(header_->slot_bytes == layout.slot_bytes && header_->ring_bytes == layout.ring_bytes,
             "TORCHPAR_SHM_SLOT_BYTES / TORCHPAR_SHM_RING_BYTES differ between rank 0 (",
             header_->slot_bytes, " / ", header_->ring_bytes, ") and rank ", rank_, " (",
             layout.slot_bytes, " / ", layout.ring_bytes, ")");
    TP_CHECK(header_->oneshot_max_bytes == static_cast<uint64_t>(config.oneshot_max_bytes),
             "TORCHPAR_ONESHOT_MAX_BYTES differs between rank 0 (", header_->oneshot_max_bytes,
             ") and rank ", rank_, " (", config.oneshot_max_bytes, "); every rank must use the same");
  }
  char* base = segment_.data();
  blocks_ = reinterpret_cast<RankBlock*>(base + layout.ranks_offset);
  blocks_[rank_].pid = static_cast<int32_t>(::getpid());
  header_->mapped.fetch_add(1, std::memory_order_acq_rel);

  // Every rank needs every pid (liveness checks); rank 0 then removes the name, so from
  // here on nothing in /dev/shm outlives the processes, whatever happens to them.
  auto deadline = Clock::now() + timeout;
  while (header_->mapped.load(std::memory_order_acquire) < static_cast<uint32_t>(size_)) {
    if (Clock::now() >= deadline) {
      std::string missing;
      for (int r = 0; r < size_; ++r) {
        if (blocks_[r].pid == 0) {
          missing += (missing.empty() ? "" : ", ") + std::to_string(group_ranks.empty() ? r : group_ranks[r]);
        }
      }
      TP_THROW_TIMEOUT("timed out setting up shared memory: rank(s) ", missing,
                       " never mapped segment ", segment_.name());
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (rank_ == 0) segment_.unlink();

  monitor_ = Monitor(rank_, header_, blocks_, size_, std::move(group_ranks));
  arena_ = Arena(rank_, size_, blocks_, base + layout.slots_offset, layout.slot_bytes, &monitor_,
                 std::chrono::microseconds(config.spin_us), std::chrono::microseconds(config.yield_us));
  for (int peer = 0; peer < size_; ++peer) {
    auto ring_at = [&](int src, int dst) {
      char* at = base + layout.ring_offset(src, dst);
      return Ring(reinterpret_cast<RingHeader*>(at), at + align_up(sizeof(RingHeader), 4096),
                  layout.ring_bytes);
    };
    send_rings_.push_back(ring_at(rank_, peer));
    recv_rings_.push_back(ring_at(peer, rank_));
  }
}

void ShmTransport::abort(const std::string& reason) {
  monitor_.abort(reason);
  if (auto* engine = engine_.load(std::memory_order_acquire)) engine->fail(std::make_exception_ptr(Error(reason)));
}

size_t ShmTransport::write_some(int peer, const void* data, size_t n) {
  try {
    return send_rings_[peer].write_some(data, n);
  } catch (const Error& e) {
    TP_THROW("the ring to rank ", monitor_.name(peer), ": ", e.what());
  }
}

size_t ShmTransport::read_some(int peer, void* data, size_t n) {
  try {
    return recv_rings_[peer].read_some(data, n);
  } catch (const Error& e) {
    TP_THROW("the ring from rank ", monitor_.name(peer), ": ", e.what());
  }
}

void ShmTransport::notify(int peer) { blocks_[peer].doorbell.bump(); }

uint32_t ShmTransport::activity() const { return blocks_[rank_].doorbell.load(); }

void ShmTransport::sleep_until_activity(uint32_t seen, std::chrono::microseconds max_sleep) {
  blocks_[rank_].doorbell.sleep_while(seen, max_sleep);
}

void ShmTransport::check_peer(int peer) { monitor_.check(peer); }

}  // namespace torchpar::shm
