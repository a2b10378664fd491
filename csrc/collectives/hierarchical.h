// Collectives of a group spanning hosts (issue 21), where the ranks of each host share
// memory (Comm::hierarchy): the work inside a host goes through its arena, and only one
// leader per host (its lowest rank) talks to the other hosts, over TCP. Hosts may hold any
// number of ranks, and their ranks need not be contiguous.
//
// Every collective of such a group begins with agree(): each host's ranks publish their
// call's descriptor in the host's arena, the leaders exchange their hosts' descriptors, and
// each leader hands the whole table back to its host. Every rank thus checks every rank's
// call and a mismatch is the same error on every rank, as in the flat algorithms.
//
// all_reduce: reduce into the leader through the arena (sum over the host's ranks, in rank
// order, at once), all-reduce among the leaders (sum over hosts, in the order of their
// lowest ranks, at once: p2p/reduce.cpp), then broadcast within each host. AVG sums both
// ways and the leader divides by the group's size. Integer results equal the flat
// algorithm's exactly; floating-point sums are added in that order (hosts' partial sums,
// rounded to the dtype for float16/bfloat16), and every rank gets the leader's bytes, so
// the result is bit-identical on every rank.
//
// broadcast: within the root's host from the root, among the leaders from the root's
// host's leader, then within every other host from its leader.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstddef>

#include "collectives/comm.h"
#include "collectives/reduce_op.h"
#include "collectives/segments.h"

namespace torchpar::collectives::hier {

// The descriptor check of a group spanning hosts (above): "" when every rank called the same,
// else the message every rank throws.
std::string agree(Comm& c, const shm::OpDesc& desc);

void allreduce(Comm& c, const Segments& data, size_t count, c10::ScalarType dtype, ReduceOp op);
void broadcast(Comm& c, void* data, size_t count, c10::ScalarType dtype, int root);

}  // namespace torchpar::collectives::hier
