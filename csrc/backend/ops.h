// The collectives of torch's c10d surface, one record each: its OpType and the name errors
// use, its arguments checked on the calling thread (the constructor: bad input fails at the
// call site, before anything is queued), the tensors its Work hands back (outputs), and what
// the group's queue runs (run: stage the tensors as raw buffers, call the algorithm in
// collectives/, copy results back). ProcessGroupTorchpar submits every one of them through
// one template, submit<Op>.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <vector>

#include "collectives/comm.h"
#include "collectives/reduce_op.h"

namespace torchpar::ops {

using collectives::Comm;
using c10d::OpType;

struct Broadcast {
  static constexpr OpType kType = OpType::BROADCAST;
  static constexpr const char* kName = "broadcast";
  Broadcast(const std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts, int rank, int size);
  std::vector<at::Tensor> outputs() const { return {t}; }
  void run(Comm& c) const;
  at::Tensor t;
  int root;
};

struct Allreduce {
  static constexpr OpType kType = OpType::ALLREDUCE;
  static constexpr const char* kName = "all_reduce";
  Allreduce(const std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts, int rank, int size);
  std::vector<at::Tensor> outputs() const { return {t}; }
  void run(Comm& c) const;
  at::Tensor t;
  collectives::ReduceOp op;
  c10d::ReduceOp user_op;
};

// SUM of sparse COO tensors, as gloo (sparse.cpp).
struct SparseAllreduce {
  static constexpr OpType kType = OpType::ALLREDUCE;
  static constexpr const char* kName = "all_reduce";
  SparseAllreduce(const std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts, int rank, int size);
  std::vector<at::Tensor> outputs() const { return {t}; }
  void run(Comm& c) const;
  at::Tensor t;
};

struct AllreduceCoalesced {
  static constexpr OpType kType = OpType::COALESCED;
  static constexpr const char* kName = "all_reduce_coalesced";
  AllreduceCoalesced(const std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts,
                     int rank, int size);
  std::vector<at::Tensor> outputs() const { return ts; }
  void run(Comm& c) const;
  std::vector<at::Tensor> ts;
  collectives::ReduceOp op;
  c10d::ReduceOp user_op;
  bool in_place;  // reduced where they lie, as one collective over all of them
};

struct Reduce {
  static constexpr OpType kType = OpType::REDUCE;
  static constexpr const char* kName = "reduce";
  Reduce(const std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts, int rank, int size);
  std::vector<at::Tensor> outputs() const { return {t}; }
  void run(Comm& c) const;
  at::Tensor t;
  collectives::ReduceOp op;
  c10d::ReduceOp user_op;
  int root;
};

struct Allgather {
  static constexpr OpType kType = OpType::ALLGATHER;
  static constexpr const char* kName = "all_gather";
  Allgather(const std::vector<std::vector<at::Tensor>>& outputs, const std::vector<at::Tensor>& inputs,
            const c10d::AllgatherOptions& opts, int rank, int size);
  std::vector<at::Tensor> outputs() const { return outs; }
  void run(Comm& c) const;
  at::Tensor in;
  std::vector<at::Tensor> outs;
};

struct AllgatherIntoTensor {
  static constexpr OpType kType = OpType::_ALLGATHER_BASE;
  static constexpr const char* kName = "all_gather_into_tensor";
  AllgatherIntoTensor(const at::Tensor& output, const at::Tensor& input, const c10d::AllgatherOptions& opts,
                      int rank, int size);
  std::vector<at::Tensor> outputs() const { return {out}; }
  void run(Comm& c) const;
  at::Tensor in, out;
};

struct Gather {
  static constexpr OpType kType = OpType::GATHER;
  static constexpr const char* kName = "gather";
  Gather(const std::vector<std::vector<at::Tensor>>& outputs, const std::vector<at::Tensor>& inputs,
         const c10d::GatherOptions& opts, int rank, int size);
  std::vector<at::Tensor> outputs() const { return outs; }
  void run(Comm& c) const;
  at::Tensor in;
  std::vector<at::Tensor> outs;  // the root's only
  int root;
};

struct Scatter {
  static constexpr OpType kType = OpType::SCATTER;
  static constexpr const char* kName = "scatter";
  Scatter(const std::vector<at::Tensor>& outputs, const std::vector<std::vector<at::Tensor>>& inputs,
          const c10d::ScatterOptions& opts, int rank, int size);
  std::vector<at::Tensor> outputs() const { return {out}; }
  void run(Comm& c) const;
  std::vector<at::Tensor> ins;  // the root's only
  at::Tensor out;
  int root;
};

struct ReduceScatter {
  static constexpr OpType kType = OpType::REDUCE_SCATTER;
  static constexpr const char* kName = "reduce_scatter";
  ReduceScatter(const std::vector<at::Tensor>& outputs, const std::vector<std::vector<at::Tensor>>& inputs,
                const c10d::ReduceScatterOptions& opts, int rank, int size);
  std::vector<at::Tensor> outputs() const { return {out}; }
  void run(Comm& c) const;
  std::vector<at::Tensor> ins;
  at::Tensor out;
  collectives::ReduceOp op;
  c10d::ReduceOp user_op;
};

struct ReduceScatterTensor {
  static constexpr OpType kType = OpType::_REDUCE_SCATTER_BASE;
  static constexpr const char* kName = "reduce_scatter_tensor";
  ReduceScatterTensor(const at::Tensor& output, const at::Tensor& input, const c10d::ReduceScatterOptions& opts,
                      int rank, int size);
  std::vector<at::Tensor> outputs() const { return {out}; }
  void run(Comm& c) const;
  at::Tensor in, out;
  collectives::ReduceOp op;
  c10d::ReduceOp user_op;
};

struct AlltoallSingle {
  static constexpr OpType kType = OpType::ALLTOALL_BASE;
  static constexpr const char* kName = "all_to_all_single";
  AlltoallSingle(const at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& output_split_sizes,
                 const std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& opts, int rank,
                 int size);
  std::vector<at::Tensor> outputs() const { return {out}; }
  void run(Comm& c) const;
  at::Tensor in, out;
  std::vector<size_t> send_counts, recv_counts;  // elements per rank
};

struct Alltoall {
  static constexpr OpType kType = OpType::ALLTOALL;
  static constexpr const char* kName = "all_to_all";
  Alltoall(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
           const c10d::AllToAllOptions& opts, int rank, int size);
  std::vector<at::Tensor> outputs() const { return outs; }
  void run(Comm& c) const;
  std::vector<at::Tensor> ins, outs;
};

struct Barrier {
  static constexpr OpType kType = OpType::BARRIER;
  static constexpr const char* kName = "barrier";
  Barrier(const c10d::BarrierOptions&, int, int) {}
  std::vector<at::Tensor> outputs() const { return {}; }
  void run(Comm& c) const;
};

}  // namespace torchpar::ops
