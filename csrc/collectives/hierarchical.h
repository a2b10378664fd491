// Collectives of a group spanning hosts (issue 21), where the ranks of each host share
// memory (Comm::hierarchy): the work inside a host goes through its arena, and between hosts
// one leader per host (its lowest rank) talks to the other hosts over TCP, or, on hosts of
// equal size (all_gather, reduce_scatter, large all_reduce), every rank to its peers of the
// same local rank (rails). Hosts may hold any number of ranks, and their ranks need not be contiguous.
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
// the result is bit-identical on every rank. On hosts of equal size, calls beyond two
// arena slots run by rails instead (hierarchical_allreduce.cpp): the same sums, each rank
// doing a 1/L share.
//
// broadcast: within the root's host from the root, among the leaders from the root's
// host's leader, then within every other host from its leader.
//
// all_gather and reduce_scatter (hierarchical_allgather.cpp, hierarchical_reduce.cpp): on
// hosts of equal size by rails, local rank l of every host exchanging with local rank l of
// every other over TCP, beside an all-gather (a reduce-scatter, before) inside each host, so
// every rank does a 1/L share; on hosts of unequal size through the leaders (all_gather
// within each host, the leaders exchange their hosts' blocks, each broadcasts the others'
// within its host; reduce_scatter reduces every block to the leader, the hosts' partials go
// leader to leader, are added in host order and scattered within each host). Either way a
// rank's block crosses the network once per other host, not once per rank there, and
// reduce_scatter adds in all_reduce's order: bit-identical to it.
//
// reduce (hierarchical_reduce.cpp): reduce within each host through its arena to the root
// on the root's host and the leader on the others, those send their partials to the root,
// which adds them in host order.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstddef>
#include <string>
#include <vector>

#include "collectives/comm.h"
#include "collectives/reduce_op.h"
#include "collectives/segments.h"

namespace torchpar::collectives::hier {

// The descriptor check of a group spanning hosts (above): "" when every rank called the same,
// else the message every rank throws.
std::string agree(Comm& c, const shm::OpDesc& desc);

// Whether every host has the same number of ranks, two or more: all_gather, reduce_scatter
// and large all_reduce then run by rails (local rank l of every host with local rank l of
// every other), not through one leader per host.
bool even_hosts(const HostMap& map);
// This rank's rail: member g is the rank of host g with this rank's local rank (its peer there).
std::vector<int> rail_of(const Hierarchy& h);

// Whether a reduction with `op` over `dtype` runs flat even across hosts: float16 sums
// (and averages, products). The hierarchical path stores each host's partial in the dtype
// before the hosts' are added, which can overflow (2 x 40000 > 65504) where the flat path,
// widening to float32 and rounding once, does not (review finding). bfloat16 has float32's
// range: it stays hierarchical (rounded once more, after the host's stage).
bool reduces_flat(c10::ScalarType dtype, ReduceOp op);

void allreduce(Comm& c, const Segments& data, size_t count, c10::ScalarType dtype, ReduceOp op);
void broadcast(Comm& c, void* data, size_t count, c10::ScalarType dtype, int root);
void allgather(Comm& c, const void* in, void* const* outs, size_t count, c10::ScalarType dtype);
void reduce_scatter(Comm& c, const void* const* ins, void* out, size_t count, c10::ScalarType dtype, ReduceOp op);
void reduce(Comm& c, void* data, size_t count, c10::ScalarType dtype, ReduceOp op, int root);

// The sub-communicators the hierarchical collectives run on: this host's ranks over its
// arena (null arena when the rank is alone on its host), and one rank per host over
// point-to-point messages (member g is `ranks`[g]: the hosts' leaders, or for reduce the
// root on the root's host).
Comm host_comm(const Comm& c);
Comm hosts_comm(const Comm& c, const std::vector<int>& ranks);
// hosts_comm over the hosts' leaders (member g is host g's leader).
Comm leaders_comm(const Comm& c);

}  // namespace torchpar::collectives::hier
