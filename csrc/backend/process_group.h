// The "torchpar" torch.distributed backend.
//
// Two engines, as in MPI implementations:
// - collectives run on one worker thread per group, in the order they were issued, since
//   every rank must execute them in the same order;
// - point-to-point operations bypass that queue: they are posted straight to the
//   transport's tag-matching engine, so a collective never waits behind an unrelated irecv.
//
// CUDA tensors go to the CUDA half (backend/cuda.h: NCCL) instead; a call mixing CPU and CUDA
// tensors is refused. Every call validates its arguments at once, on the calling thread (a
// bad root is an error at the call site); the work itself runs asynchronously and is waited
// for through the returned Work. A timeout, a dead peer or an abort by another rank fails
// the group: that operation and every later one raise, on every live rank.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/queue.h"
#include "backend/work.h"
#include "common/env.h"
#include "transport/rendezvous.h"
#include "transport/shm/shm_transport.h"

namespace torchpar {

class ProcessGroupTorchpar : public c10d::Backend {
 public:
  ProcessGroupTorchpar(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, std::string group_name);
  ~ProcessGroupTorchpar() override;

  const std::string getBackendName() const override { return "torchpar"; }
  bool supportsCoalescing() const override { return true; }
  void setTimeout(std::chrono::milliseconds timeout) override;
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  void shutdown() override;
  void abort() override;
  // abort() giving the peers a reason: their pending and later operations of the group fail
  // with "the group was aborted by rank <this>: <reason>".
  void abort(const std::string& reason);

  // c10d's sequence number: how many collectives this rank has issued on the group, the
  // same on every rank while they are in step (ProcessGroupWrapper's debug checks compare
  // them; torch calls setSequenceNumberForGroup on new groups). Point-to-point is not
  // counted: only the two ranks of a pair take part in it.
  void setSequenceNumberForGroup() override { issued_ = 0; }
  uint64_t getSequenceNumberForGroup() override { return issued_; }

  // Rank 0 waits up to `opts.timeout` for every other rank to reach the barrier, then
  // releases them; a rank that does not arrive in time is named in the error rank 0 raises
  // (the first one late, or with `wait_all_ranks` all of them). The other ranks fail if
  // rank 0 does not release them in time. Runs on the caller's thread, beside the queue.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks = false) override;

  // "shm" or "tcp".
  std::string transport_name() const { return transport_->name(); }
  // Name of the group's shared-memory segment (already unlinked; for tests and logs), or ""
  // over TCP.
  std::string segment_name() const {
    auto* shm = dynamic_cast<shm::ShmTransport*>(transport_.get());
    return shm ? shm->segment_name() : "";
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

 private:
  // Every collective of the c10d surface: `Op` (backend/ops.h) checks its arguments here, on
  // the calling thread, and runs in the group's queue.
  template <typename Op, typename Options, typename... Args>
  c10::intrusive_ptr<c10d::Work> submit(const Options& opts, Args&&... args) {
    check_cpu_in_block(Op::kName);
    Op op(std::forward<Args>(args)..., opts, getRank(), getSize());
    auto work = c10::make_intrusive<Work>(getRank(), Op::kType, Op::kName, op.outputs());
    ++issued_;
    queue_->submit(work, Op::kName, [op = std::move(op)](collectives::Comm& c) { op.run(c); },
                   timeout_for(opts.timeout), opts.asyncOp);
    // After submit: one refused (the group shut down) would never complete endCoalescing's work.
    if (coalescing_) coalesced_.push_back(work);  // endCoalescing's work waits for it too
    return work;
  }
  c10::intrusive_ptr<Work> post_p2p(bool is_send, at::Tensor& tensor, int peer, int tag);
  // The CUDA half (backend/cuda.h), made on first use; inside a coalescing block it opens
  // the half's block too. Raises in a build without CUDA.
  c10d::Backend& cuda();
  // For a call on CPU tensors inside a coalescing block: refuses one that CUDA calls began.
  void check_cpu_in_block(const char* op) const;
  std::chrono::milliseconds timeout_for(std::chrono::milliseconds requested) const;

  const std::string group_name_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::Store> store_;
  Config config_;
  std::unique_ptr<Rendezvous> rendezvous_;  // the TCP transport reports aborts through it
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<CollectiveQueue> queue_;

  std::atomic<uint64_t> issued_{0};  // collectives issued, for getSequenceNumberForGroup
  uint64_t monitored_barriers_ = 0;  // caller thread: tells apart the monitored barriers' messages

  bool coalescing_ = false;  // caller thread only
  std::vector<c10::intrusive_ptr<Work>> coalesced_;
  bool cuda_in_block_ = false;  // the block holds CUDA calls (the CUDA half's own block)

  std::mutex cuda_mu_;  // guards cuda_'s creation
  c10::intrusive_ptr<c10d::Backend> cuda_;
};

}  // namespace torchpar
