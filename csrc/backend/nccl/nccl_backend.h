// The CUDA half of the "torchpar" backend: every c10d operation on CUDA tensors, through
// NCCL. ProcessGroupTorchpar hands it each call whose tensors are on a GPU; the CPU
// transports never see them.
//
// - Communicators are made on first use, per device: one for the whole group (collectives,
//   and point-to-point inside a coalescing block, as batch_isend_irecv issues it), and one
//   per pair of ranks for a lone send/recv, so that two ranks can talk without the others
//   taking part in its set-up. Their unique ids travel through the group's store.
// - Each communicator has its own stream. An operation first makes that stream wait for the
//   caller's current stream (the producers of its inputs), enqueues its NCCL calls there,
//   records an end event and returns at once (NcclWork says what waiting on it means).
// - The arguments are checked by the same records as the CPU path's (backend/ops.h), on the
//   calling thread, before anything is enqueued.
// - The watchdog (watchdog.h) fails the group on a timeout or an asynchronous NCCL error;
//   after that every call raises the first error at once.
// - NCCL matches point-to-point messages by order per pair of ranks: tags are not used.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/nccl/nccl_work.h"
#include "backend/nccl/watchdog.h"
#include "collectives/nccl/collectives.h"
#include "transport/rendezvous.h"

namespace torchpar {

class NcclBackend : public c10d::Backend {
 public:
  NcclBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout,
              std::string group_name);
  ~NcclBackend() override;

  const std::string getBackendName() const override { return "torchpar"; }
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  bool coalescing() const { return coalescing_; }
  void shutdown() override;
  void abort() override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
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
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override;

 private:
  // A communicator and the stream its operations run on.
  struct Channel {
    std::shared_ptr<nccl::Communicator> comm;
    c10::cuda::CUDAStream stream;
  };
  // What an operation does after its NCCL calls have been launched (copies into the user's
  // tensors), on the same stream; empty when nothing.
  using Then = std::function<void()>;
  // An operation's NCCL calls; runs on the caller's thread with the channel's stream current.
  using Body = std::function<Then(const nccl::Launch&)>;

  // (device index, sender, receiver): sender and receiver -1 for the group's channel.
  using ChannelKey = std::tuple<int, int, int>;
  // The channel `id` names, made on first use.
  Channel& channel(const ChannelKey& id, at::Device device);
  // The group's channel on `device` (every rank must reach its set-up).
  Channel& group_channel(at::Device device);
  // The two-rank channel carrying messages from rank `from` to rank `to` on `device`. One per
  // direction, each with its own stream: a send and a receive between the same two ranks
  // never queue behind each other (1F1B sends activations one way, gradients the other).
  Channel& p2p_channel(at::Device device, int from, int to);
  // Checks that the group is usable and returns the one device all `tensors` are on.
  at::Device device_of(const std::vector<at::Tensor>& tensors, const char* op);
  // Enqueues `body` on `channel`'s stream after the caller's current stream; the work
  // holds `inputs` and `outputs` until it is done.
  c10::intrusive_ptr<c10d::Work> launch(Channel& channel, at::Device device, c10d::OpType type, const char* name,
                                        std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs,
                                        const Body& body);
  // launch() on the group's channel, for the collectives.
  c10::intrusive_ptr<c10d::Work> collective(c10d::OpType type, const char* name, std::vector<at::Tensor> inputs,
                                            std::vector<at::Tensor> outputs, const Body& body);
  c10::intrusive_ptr<c10d::Work> point_to_point(bool is_send, at::Tensor& tensor, int peer);
  // Issues several operations as one coalescing block (or inside the caller's block).
  c10::intrusive_ptr<c10d::Work> as_one_block(const std::function<void()>& issue);
  // The first failure: aborts every communicator; later calls raise `error`.
  void fail(std::exception_ptr error);
  void check_usable();

  const std::string group_name_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<Rendezvous> store_;

  std::mutex setup_mu_;  // one channel set-up at a time; guards made_
  std::map<std::string, uint64_t> made_;  // communicators made per kind: the store keys' serials
  std::mutex mu_;  // guards channels_ and failure_
  std::map<ChannelKey, Channel> channels_;
  std::exception_ptr failure_;

  uint64_t issued_ = 0;  // collectives issued, for messages

  // A coalescing block (caller thread only): its operations wait here, checked, until the
  // block ends; then their NCCL calls go into one ncclGroupStart/End, and their works get
  // their end events.
  struct Pending {
    Channel* channel;
    at::Device device;
    Body body;
    c10::intrusive_ptr<NcclWork> work;
    CudaEvent ready;  // recorded on the caller's stream when the operation was issued
  };
  bool coalescing_ = false;
  std::vector<Pending> pending_;

  Watchdog watchdog_;  // last: its thread stops before the rest is destroyed
};

}  // namespace torchpar
