#include "collectives/comm.h"

#include <algorithm>
#include <sstream>

#include "collectives/reduce_op.h"
#include "common/error.h"

namespace torchpar::collectives {

const char* name(OpKind kind) {
  switch (kind) {
    case OpKind::kAllreduce: return "all_reduce";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kReduce: return "reduce";
    case OpKind::kAllgather: return "all_gather";
    case OpKind::kGather: return "gather";
    case OpKind::kScatter: return "scatter";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kAlltoall: return "all_to_all";
    case OpKind::kBarrier: return "barrier";
  }
  return "?";
}

size_t element_size(c10::ScalarType dtype) { return c10::elementSize(dtype); }

shm::OpDesc op_desc(OpKind kind, c10::ScalarType dtype, uint64_t count, int root, int reduce_op) {
  shm::OpDesc d;
  d.op = static_cast<uint32_t>(kind);
  d.dtype = static_cast<int32_t>(dtype);
  d.count = count;
  d.root = root;
  d.reduce_op = reduce_op;
  return d;
}

char* Comm::staging(size_t bytes) {
  TP_CHECK(scratch != nullptr, "this collective needs staging memory and the group provides none");
  if (scratch->size() < bytes) {
    scratch->clear();  // nothing to copy over
    scratch->shrink_to_fit();
    scratch->resize(bytes);
  }
  return scratch->data();
}

void Comm::wait_slot_free() { arena().wait_all(arena().step(), deadline, busy_wait); }

void Comm::begin(const shm::OpDesc& desc) {
  wait_slot_free();
  arena().desc(rank()) = desc;
}

namespace {

std::string describe(const shm::OpDesc& d) {
  std::ostringstream os;
  os << name(static_cast<OpKind>(d.op));
  if (d.op != static_cast<uint32_t>(OpKind::kBarrier)) {
    os << " of " << d.count << " x " << c10::toString(static_cast<c10::ScalarType>(d.dtype));
  }
  if (d.op == static_cast<uint32_t>(OpKind::kAllreduce) ||
      d.op == static_cast<uint32_t>(OpKind::kReduce) ||
      d.op == static_cast<uint32_t>(OpKind::kReduceScatter)) {
    os << " op " << name(static_cast<ReduceOp>(d.reduce_op));
  }
  if (d.op == static_cast<uint32_t>(OpKind::kBroadcast) || d.op == static_cast<uint32_t>(OpKind::kReduce) ||
      d.op == static_cast<uint32_t>(OpKind::kGather) || d.op == static_cast<uint32_t>(OpKind::kScatter)) {
    os << " root " << d.root;
  }
  return os.str();
}

}  // namespace

std::string mismatch(const std::vector<shm::OpDesc>& descs, uint64_t seq) {
  bool same = std::all_of(descs.begin(), descs.end(), [&](const shm::OpDesc& d) { return d == descs[0]; });
  if (same) return "";
  std::ostringstream os;
  os << "collective mismatch across ranks (collective #" << seq << " of this group): ";
  for (size_t r = 0; r < descs.size(); ++r) {
    os << (r ? "; " : "") << "rank " << r << " called " << describe(descs[r]);
  }
  return os.str();
}

void Comm::check_descriptors() {
  std::vector<shm::OpDesc> descs(size());
  for (int r = 0; r < size(); ++r) descs[r] = arena().desc(r);
  std::string message = mismatch(descs, seq);
  if (message.empty()) return;
  arrive();  // tell peers we are done reading the descriptors before anyone rewrites them
  throw UsageError(message);
}

Piece piece_of(size_t count, int world, int r) {
  size_t per = (count + world - 1) / world;
  per = (per + 15) / 16 * 16;
  size_t begin = std::min(count, per * r);
  size_t end = std::min(count, begin + per);
  return Piece{begin, end};
}

}  // namespace torchpar::collectives
