// The collectives on CUDA buffers, as NCCL calls on one communicator and stream: the CUDA
// counterpart of collectives/collectives.h (same shapes: raw buffers, element counts, a
// dtype). NCCL runs the algorithms; what is ours is how the c10d operations NCCL lacks
// (gather, scatter, uneven all-to-all) are built from its grouped send/recv.
//
// Every call enqueues on `stream` and returns; the caller holds the communicator's lock()
// and records an event after the last call to learn when the work is done.
#pragma once

#include <c10/core/ScalarType.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <optional>
#include <vector>

#include "transport/nccl/communicator.h"

namespace torchpar::nccl {

// NCCL's type for `dtype` (bool travels as uint8, complex as pairs of its real type: the
// caller views it as real), or none (int16, the float8 and quantized types ...).
std::optional<ncclDataType_t> data_type(c10::ScalarType dtype);

// What one call enqueues on: the communicator, the stream and the deadline for NCCL's
// non-blocking enqueue.
struct Launch {
  Communicator& comm;
  cudaStream_t stream;
  Clock::time_point deadline;
};

void allreduce(const Launch& l, const void* in, void* out, size_t count, ncclDataType_t type, ncclRedOp_t op);
void broadcast(const Launch& l, void* buf, size_t count, ncclDataType_t type, int root);
void reduce(const Launch& l, const void* in, void* out, size_t count, ncclDataType_t type, ncclRedOp_t op,
            int root);
// `out` holds size() * count elements, rank r's at r * count.
void allgather(const Launch& l, const void* in, void* out, size_t count, ncclDataType_t type);
// `in` holds size() * count elements; this rank gets the reduction of block rank().
void reduce_scatter(const Launch& l, const void* in, void* out, size_t count, ncclDataType_t type,
                    ncclRedOp_t op);
void send(const Launch& l, const void* buf, size_t count, ncclDataType_t type, int peer);
void recv(const Launch& l, void* buf, size_t count, ncclDataType_t type, int peer);

// Grouped send/recv. `outs` (the root's only) has size() buffers of `count` elements.
void gather(const Launch& l, const void* in, const std::vector<void*>& outs, size_t count, ncclDataType_t type,
            int root);
void scatter(const Launch& l, const std::vector<const void*>& ins, void* out, size_t count, ncclDataType_t type,
             int root);
// Rank r receives send_counts[me] elements from every rank me into recvs[r]; counts may differ.
void alltoall(const Launch& l, const std::vector<const void*>& sends, const std::vector<size_t>& send_counts,
              const std::vector<void*>& recvs, const std::vector<size_t>& recv_counts, ncclDataType_t type);

// ncclGroupStart/ncclGroupEnd around a scope: NCCL launches what was enqueued inside as one
// operation (grouped send/recv cannot deadlock on each other's order).
class Group {
 public:
  explicit Group(const Launch& l);
  ~Group() noexcept(false);  // ends the group, waiting out the non-blocking enqueue
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

 private:
  const Launch& l_;
  int uncaught_;
};

}  // namespace torchpar::nccl
