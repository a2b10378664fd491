#include "collectives/nccl/collectives.h"

#include <exception>

#include "common/error.h"

namespace torchpar::nccl {

std::optional<ncclDataType_t> data_type(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat: case c10::kComplexFloat: return ncclFloat32;
    case c10::kDouble: case c10::kComplexDouble: return ncclFloat64;
    case c10::kHalf: return ncclFloat16;
    case c10::kBFloat16: return ncclBfloat16;
    case c10::kChar: return ncclInt8;
    case c10::kByte: case c10::kBool: return ncclUint8;
    case c10::kInt: return ncclInt32;
    case c10::kLong: return ncclInt64;
    default:
      return std::nullopt;
  }
}

void allreduce(const Launch& l, const void* in, void* out, size_t count, ncclDataType_t type, ncclRedOp_t op) {
  l.comm.check(ncclAllReduce(in, out, count, type, op, l.comm.get(), l.stream), "ncclAllReduce", l.deadline);
}

void broadcast(const Launch& l, void* buf, size_t count, ncclDataType_t type, int root) {
  l.comm.check(ncclBroadcast(buf, buf, count, type, root, l.comm.get(), l.stream), "ncclBroadcast", l.deadline);
}

void reduce(const Launch& l, const void* in, void* out, size_t count, ncclDataType_t type, ncclRedOp_t op,
            int root) {
  l.comm.check(ncclReduce(in, out, count, type, op, root, l.comm.get(), l.stream), "ncclReduce", l.deadline);
}

void allgather(const Launch& l, const void* in, void* out, size_t count, ncclDataType_t type) {
  l.comm.check(ncclAllGather(in, out, count, type, l.comm.get(), l.stream), "ncclAllGather", l.deadline);
}

void reduce_scatter(const Launch& l, const void* in, void* out, size_t count, ncclDataType_t type,
                    ncclRedOp_t op) {
  l.comm.check(ncclReduceScatter(in, out, count, type, op, l.comm.get(), l.stream), "ncclReduceScatter",
               l.deadline);
}

void send(const Launch& l, const void* buf, size_t count, ncclDataType_t type, int peer) {
  l.comm.check(ncclSend(buf, count, type, peer, l.comm.get(), l.stream), "ncclSend", l.deadline);
}

void recv(const Launch& l, void* buf, size_t count, ncclDataType_t type, int peer) {
  l.comm.check(ncclRecv(buf, count, type, peer, l.comm.get(), l.stream), "ncclRecv", l.deadline);
}

void gather(const Launch& l, const void* in, const std::vector<void*>& outs, size_t count, ncclDataType_t type,
            int root) {
  Group group(l);
  if (l.comm.rank() == root) {
    for (int r = 0; r < l.comm.size(); ++r) recv(l, outs[r], count, type, r);
  }
  send(l, in, count, type, root);
}

void scatter(const Launch& l, const std::vector<const void*>& ins, void* out, size_t count, ncclDataType_t type,
             int root) {
  Group group(l);
  if (l.comm.rank() == root) {
    for (int r = 0; r < l.comm.size(); ++r) send(l, ins[r], count, type, r);
  }
  recv(l, out, count, type, root);
}

void alltoall(const Launch& l, const std::vector<const void*>& sends, const std::vector<size_t>& send_counts,
              const std::vector<void*>& recvs, const std::vector<size_t>& recv_counts, ncclDataType_t type) {
  Group group(l);
  for (int r = 0; r < l.comm.size(); ++r) {
    // A zero-length pair still matches on both sides; NCCL treats it as a no-op.
    send(l, sends[r], send_counts[r], type, r);
    recv(l, recvs[r], recv_counts[r], type, r);
  }
}

Group::Group(const Launch& l) : l_(l), uncaught_(std::uncaught_exceptions()) {
  l_.comm.check(ncclGroupStart(), "ncclGroupStart", l_.deadline);
}

Group::~Group() noexcept(false) {
  ncclResult_t r = ncclGroupEnd();
  // Unwinding from a failed call inside the group: that error is the one to report.
  if (std::uncaught_exceptions() > uncaught_) return;
  l_.comm.check(r, "ncclGroupEnd", l_.deadline);
}

}  // namespace torchpar::nccl
