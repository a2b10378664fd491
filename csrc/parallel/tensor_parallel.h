// Tensor-parallel communication as autograd functions (issue 17).
//
// Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053) splits a transformer's weights over
// the ranks of a group; four "region" operators move activations in and out of the split
// part, each backward being the conjugate collective of its forward:
//
//   copy_to_region      fwd identity                  bwd all-reduce
//   reduce_from_region  fwd all-reduce                bwd identity
//   scatter_to_region   fwd keep this rank's slice    bwd all-gather      (last dim)
//   gather_from_region  fwd all-gather                bwd keep the slice  (last dim)
//
// Sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198) keeps the activations
// outside the split part sharded along the sequence, replacing the all-reduce by a
// reduce-scatter and the identity by an all-gather:
//
//   scatter_to_sequence_region         fwd keep the slice   bwd all-gather      (dim 0)
//   gather_from_sequence_region        fwd all-gather       bwd reduce-scatter  (dim 0)
//   reduce_scatter_to_sequence_region  fwd reduce-scatter   bwd all-gather      (dim 0)
//
// The sequence is dimension 0 ([s, b, h], Megatron's layout): a rank's shard of a contiguous
// tensor is then one contiguous block, so all-gather and reduce-scatter run straight into and
// out of the tensors, with no packing copy.
//
// linear_with_async_comm is Megatron's LinearWithGradAccumulationAndAsyncCommunication: the
// column-parallel linear whose backward launches the input gradient's all-reduce (under
// sequence parallelism its reduce-scatter) asynchronously, computes the weight gradient
// while it runs, then waits.
//
// Only the public c10d::ProcessGroup API is used, so every operator runs on any backend
// (torchpar, gloo, nccl).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torchpar::parallel::tp {

using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

at::Tensor copy_to_region(const at::Tensor& input, const Group& group);
at::Tensor reduce_from_region(const at::Tensor& input, const Group& group);
at::Tensor scatter_to_region(const at::Tensor& input, const Group& group);
at::Tensor gather_from_region(const at::Tensor& input, const Group& group);

at::Tensor scatter_to_sequence_region(const at::Tensor& input, const Group& group);
at::Tensor gather_from_sequence_region(const at::Tensor& input, const Group& group);
at::Tensor reduce_scatter_to_sequence_region(const at::Tensor& input, const Group& group);

// input @ weight.T + bias for a weight split by output features. The input is the full
// activation (copied to the region: its gradient is all-reduced in backward) or, with
// sequence_parallel, this rank's sequence shard (all-gathered in forward, and again in
// backward rather than kept, as Megatron does, so the gathered input is not held between
// forward and backward). overlap=false waits for each collective at once (for comparison).
at::Tensor linear_with_async_comm(const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, const Group& group,
                                  bool sequence_parallel, bool overlap = true);

// Every rank's `input.sizes()` must be equal; otherwise every rank raises a ValueError that
// names `what` and lists each rank's sizes. One small all-gather of a fixed size, so the ranks
// stay in step whatever their shapes (a mismatched all-gather of the data itself could hang).
void check_same_sizes(const at::Tensor& input, const Group& group, const std::string& what);

// Bytes this rank has sent in the collectives of the operators above since the last reset,
// counted as a bandwidth-optimal (ring) algorithm sends them (nccl-tests' bus bytes: an
// all-reduce of N bytes 2(n-1)/n N, a reduce-scatter of N bytes (n-1)/n N, an all-gather of
// N-byte shards (n-1) N), for the benchmark's comparison with the analytic count. The
// shape checks are not counted.
double bytes_communicated();
void reset_bytes_communicated();

// Events of the backward of linear_with_async_comm, recorded while tracing is on, in order:
// ("launch", what) when a collective is started, ("wait", what) when the wait on it begins,
// ("done", what) when it returns, and ("wgrad_begin", "") / ("wgrad_end", "") around the
// weight-gradient matmul; a test reads the overlap from their order, not from timing.
void set_tracing(bool on);
std::vector<std::pair<std::string, std::string>> trace();

}  // namespace torchpar::parallel::tp
