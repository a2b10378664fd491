#include "collectives/p2p/exchange.h"

#include <algorithm>

#include "collectives/hierarchical.h"
#include "common/error.h"

namespace torchpar::collectives::p2p {

Exchange::~Exchange() {
  bool pending = std::any_of(posted_.begin(), posted_.end(), [](const Handle& h) { return !h->done(); });
  if (!pending) return;
  give_up(std::make_exception_ptr(
      Error("[torchpar] collective #" + std::to_string(c_.seq) + " was abandoned part-way after an error")));
}

void Exchange::drain() {
  for (auto& h : posted_) {
    while (!h->wait_for(std::chrono::milliseconds(1000))) {
    }
  }
  posted_.clear();
}

void Exchange::give_up(std::exception_ptr error) {
  c_.p2p.fail(error);
  drain();
}

uint64_t Exchange::tag(Phase phase, uint32_t index) const {
  TP_CHECK(index < (1u << 20), "a collective over point-to-point needs more than 2^20 chunks; raise "
           "TORCHPAR_P2P_CHUNK_BYTES");
  return (uint64_t{1} << 63) | ((c_.seq & 0xffffffffu) << 24) | (static_cast<uint64_t>(phase) << 20) | index;
}

Exchange::Handle Exchange::send(int peer, Phase phase, uint32_t index, const void* data, size_t bytes) {
  posted_.push_back(c_.p2p.isend(c_.peer(peer), tag(phase, index), data, bytes, c_.deadline));
  return posted_.back();
}

Exchange::Handle Exchange::recv(int peer, Phase phase, uint32_t index, void* data, size_t bytes) {
  posted_.push_back(c_.p2p.irecv(c_.peer(peer), tag(phase, index), data, bytes, c_.deadline));
  return posted_.back();
}

void Exchange::wait(const Handle& h) {
  try {
    h->wait();
  } catch (...) {
    abandon(std::current_exception());
  }
}

void Exchange::wait_all() {
  for (auto& h : posted_) wait(h);
  posted_.clear();
}

void Exchange::cancel_all() {
  for (auto& h : posted_) c_.p2p.cancel(h);  // refused once matched: drain waits for those
  drain();
}

void Exchange::abandon(std::exception_ptr error) {
  // Past agree(), every rank expects the same messages; one that does not fit (a receive
  // of the wrong size) means the ranks are out of step: the group cannot go on.
  try {
    std::rethrow_exception(error);
  } catch (const UsageError& e) {
    error = std::make_exception_ptr(Error(e.what()));
  } catch (...) {
  }
  give_up(error);
  std::rethrow_exception(error);
}

void share(Comm& c, Phase phase, void* records, size_t bytes) {
  char* at = static_cast<char*>(records);
  Exchange ex(c);
  for (int q = 0; q < c.size(); ++q) {
    if (q != c.rank()) ex.recv(q, phase, 0, at + q * bytes, bytes);
  }
  for (int q = 0; q < c.size(); ++q) {
    if (q != c.rank()) ex.send(q, phase, 0, at + c.rank() * bytes, bytes);
  }
  ex.wait_all();
}

void agree(Comm& c, const shm::OpDesc& desc, Exchange* early) {
  if (c.agreed) return;
  std::string message;
  try {
    if (c.hierarchy != nullptr && c.members == nullptr) {
      message = hier::agree(c, desc);  // through each host's arena and the hosts' leaders
    } else {
      std::vector<shm::OpDesc> descs(c.size());
      descs[c.rank()] = desc;
      share(c, Phase::kAgree, descs.data(), sizeof(shm::OpDesc));
      message = mismatch(descs, c.seq);
    }
  } catch (...) {
    if (early) early->cancel_all();  // (the group has failed: cancelling only tidies up)
    throw;
  }
  if (!message.empty()) {
    if (early) early->cancel_all();
    throw UsageError(message);
  }
}

size_t chunk_elements(const Comm& c, c10::ScalarType dtype, size_t count) {
  size_t n = static_cast<size_t>(std::max<int64_t>(c.config.p2p_chunk_bytes, 64)) / element_size(dtype);
  // Chunk numbers live in 20 bits of the tag: a huge buffer gets longer chunks instead.
  n = std::max(n, (count >> 19) + 1);
  return std::max<size_t>(16, (n + 15) / 16 * 16);
}

}  // namespace torchpar::collectives::p2p
