// Reduction operators of the collectives layer. PREMUL_SUM is not here: the backend
// scales each rank's input first and then sums, so the algorithms see only SUM.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstddef>

namespace torchpar::collectives {

enum class ReduceOp : int { kSum, kAvg, kProduct, kMin, kMax, kBand, kBor, kBxor };

const char* name(ReduceOp op);

// Throws torchpar::Error naming the op and dtype when the pair makes no sense
// (bitwise ops on floating point, AVG on bool).
void check_supported(ReduceOp op, c10::ScalarType dtype);

// dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[n_srcs-1][i] for i < count, in that
// order on every rank, so every rank computes bit-identical results. AVG divides the
// sum by `divisor`. bfloat16 and float16 accumulate in float32 and round once.
// dst may alias any source.
void reduce(c10::ScalarType dtype, ReduceOp op, void* dst, const void* const* srcs, int n_srcs,
            size_t count, int divisor);

}  // namespace torchpar::collectives
