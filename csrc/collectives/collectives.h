// The collective algorithms, written once over Comm: through the shared arena when the
// group has one, hierarchically (hierarchical.h) when its ranks share memory host by host,
// over point-to-point messages (p2p/) when they do not.
//
// Buffers are raw, contiguous, of `dtype`; counts are in elements. The backend layer
// turns tensors into these (contiguous copies, complex as real pairs, PREMUL_SUM as a
// scaled SUM). Every function is called by every rank of the group with matching
// arguments, which each checks first: a mismatch throws on every rank.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstddef>

#include "collectives/comm.h"
#include "collectives/hierarchical.h"
#include "collectives/p2p/p2p.h"
#include "collectives/reduce_op.h"
#include "collectives/segments.h"

namespace torchpar::collectives {

// In place. Small messages: every rank reduces straight from all slots (one-shot).
// Large: reduce-scatter then all-gather through the arena, chunk by chunk.
void allreduce(Comm& c, void* data, size_t count, c10::ScalarType dtype, ReduceOp op);
// The same over several buffers taken as one (`count` elements in all), each reduced in place.
void allreduce(Comm& c, const Segments& data, size_t count, c10::ScalarType dtype, ReduceOp op);

void broadcast(Comm& c, void* data, size_t count, c10::ScalarType dtype, int root);
// Through the arena only (c.shared), into buffers taken as one.
void broadcast(Comm& c, const Segments& data, size_t count, c10::ScalarType dtype, int root);

// In place on the root; other ranks' buffers are left unchanged.
void reduce(Comm& c, void* data, size_t count, c10::ScalarType dtype, ReduceOp op, int root);

// outs[r] receives rank r's `count` elements.
void allgather(Comm& c, const void* in, void* const* outs, size_t count, c10::ScalarType dtype);

// Like allgather, but only the root's `outs` are written (and read).
void gather(Comm& c, const void* in, void* const* outs, size_t count, c10::ScalarType dtype, int root);

// The root's ins[r] goes to rank r's `out`.
void scatter(Comm& c, const void* const* ins, void* out, size_t count, c10::ScalarType dtype, int root);

// out = op over ranks q of (rank q's ins[this rank]).
void reduce_scatter(Comm& c, const void* const* ins, void* out, size_t count, c10::ScalarType dtype,
                    ReduceOp op);

// Rank q's sends[r] (send_counts[r] elements) lands in rank r's recvs[q] (recv_counts[q]).
void alltoall(Comm& c, const void* const* sends, const size_t* send_counts, void* const* recvs,
              const size_t* recv_counts, c10::ScalarType dtype);

void barrier(Comm& c);

// Shared by allreduce (root = -1: every rank receives) and reduce: reduce-scatter through
// the arena, then the receivers gather the reduced pieces, chunk by chunk. In place.
void reduce_in_chunks(Comm& c, const Segments& data, size_t count, c10::ScalarType dtype, ReduceOp op,
                      int root);

}  // namespace torchpar::collectives
