// How the hierarchical collectives (hierarchical.h) cut a large call into chunks that run as
// a pipeline: while the network between hosts carries chunk k, the ranks of each host work on the
// chunks before and after it through their arena (issue 21). all_reduce, all_gather and
// reduce_scatter share this cut, so the three pipelines start and step alike. Included only
// by the hierarchical_*.cpp files (collectives.h includes hierarchical.h: kept out of it so a
// change here rebuilds four files, not the backend).
#pragma once

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstddef>

#include "collectives/comm.h"
#include "collectives/segments.h"

namespace torchpar::collectives::hier {

// The most chunks a pipelined call is cut into. Each chunk's stages synchronise the host's
// ranks and the leaders anew, which costs where the cores, not the link, are the bottleneck
// (on the loaded test machine, 16 chunks of a 64 MiB all_reduce over the plain veth took
// 1.6x as long as the stages one after the other); 8 leave about a quarter of the host
// stages' time exposed on a slow link (docs/hosts.md).
constexpr size_t kPipelineChunks = 8;

// The rails (all_gather, reduce_scatter) agree among a rail's ranks that every receive is
// posted before any of them sends (hosts_comm) only when a call has several chunks or its
// rank receives more than this many bytes from its rail: below, the round trip between
// hosts costs more than early arrivals' copies (a 4 B all_gather on 2 x 2 test hosts took
// 1.1x the flat algorithm's time with it), and the bound keeps what a rank may hold early
// (TORCHPAR_UNEXPECTED_MAX_BYTES) small however many hosts there are.
constexpr size_t kRailAgreeAboveBytes = size_t{64} << 10;

// Whether a rail's call of `chunks` chunks, in which each peer sends this rank `bytes`,
// agrees before sending (above).
inline bool rail_agrees(size_t chunks, int hosts, size_t bytes) {
  return chunks > 1 || static_cast<size_t>(hosts - 1) * bytes > kRailAgreeAboveBytes;
}

// Elements per chunk of each of `blocks` blocks of `count` elements (a call that moves
// blocks x count elements through each host: 1 for all_reduce, the group's size for
// all_gather and reduce_scatter, whose chunk k is the k-th chunk of every rank's block), or 0
// when the whole call fits in two arena slots and its stages run one after the other.
// Otherwise a chunk of all blocks is a slot or more, a multiple of 16 elements, and there are
// at most kPipelineChunks of them. Every rank decides alike (the counts and the slot size are
// the same on all), which the pipelines' tags (chunk numbers) rely on.
size_t pipeline_chunk(const Comm& c, c10::ScalarType dtype, size_t count, size_t blocks = 1);

// Chunk k of a pipeline over `count` elements in chunks of `chunk`.
inline Piece chunk_span(size_t k, size_t chunk, size_t count) {
  return Piece{std::min(count, k * chunk), std::min(count, (k + 1) * chunk)};
}

// Bytes [begin, begin + bytes) of `s`, as a Segments of its own.
Segments slice(const Segments& s, size_t begin, size_t bytes);

}  // namespace torchpar::collectives::hier
