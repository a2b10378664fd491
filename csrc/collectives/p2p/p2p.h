// The collectives over point-to-point messages, for groups whose ranks cannot share
// memory (the TCP transport). Same contracts as collectives.h, which dispatches here when
// Comm has no arena.
//
// Every collective first exchanges descriptors with every peer (agree()), so a mismatch is
// the same error on every rank before any data moves. Data then goes straight from each
// rank to the rank that needs it (W−1 concurrent messages per step rather than a ring's
// W−1 sequential steps: the same bytes per rank, fewer round trips), and every reduction
// sums all W contributions at once, in rank order, exactly as the shared-memory
// algorithms do: the results are bit-identical across ranks and transports.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstddef>

#include "collectives/comm.h"
#include "collectives/reduce_op.h"
#include "collectives/segments.h"

namespace torchpar::collectives::p2p {

void allreduce(Comm& c, const Segments& data, size_t count, c10::ScalarType dtype, ReduceOp op);
void reduce(Comm& c, void* data, size_t count, c10::ScalarType dtype, ReduceOp op, int root);
void reduce_scatter(Comm& c, const void* const* ins, void* out, size_t count, c10::ScalarType dtype,
                    ReduceOp op);
void broadcast(Comm& c, void* data, size_t count, c10::ScalarType dtype, int root);
void allgather(Comm& c, const void* in, void* const* outs, size_t count, c10::ScalarType dtype);
void gather(Comm& c, const void* in, void* const* outs, size_t count, c10::ScalarType dtype, int root);
void scatter(Comm& c, const void* const* ins, void* out, size_t count, c10::ScalarType dtype, int root);
void alltoall(Comm& c, const void* const* sends, const size_t* send_counts, void* const* recvs,
              const size_t* recv_counts, c10::ScalarType dtype);
void barrier(Comm& c);

}  // namespace torchpar::collectives::p2p
