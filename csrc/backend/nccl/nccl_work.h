// The handle of a torchpar operation on CUDA tensors.
//
// The contract, as c10d's for a device backend:
// - wait(): the caller's current CUDA stream waits for the operation's end event; the host
//   does not block. With an explicit timeout the host blocks too, at most that long. Either
//   raises the operation's error once the watchdog has found one.
// - synchronize(): the host blocks until the operation is done (or has failed).
// - isCompleted()/isSuccess()/exception() never block.
// - getFuture(): a CUDA-aware future, completed on the communication stream when the
//   operation was enqueued (c10::ivalue::Future's device semantics: waiting on it, or a
//   callback chained to it, is ordered after the end event on the device).
// The work holds its tensors until the end event has passed, so the caching allocator
// cannot hand their memory to someone else while NCCL still reads or writes it.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "backend/nccl/cuda_event.h"
#include "transport/nccl/communicator.h"

namespace torchpar {

class NcclWork : public c10d::Work {
 public:
  NcclWork(int rank, c10d::OpType type, std::string name, uint64_t seq, at::Device device,
           std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs,
           std::shared_ptr<nccl::Communicator> comm, std::chrono::milliseconds timeout);

  // After the last NCCL call, with `stream` current: records the end event and completes
  // the future there. Starts the timeout's clock.
  void enqueued(const c10::cuda::CUDAStream& stream);

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;
  bool isCompleted() override;
  bool isSuccess() const override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }

  // For the watchdog. Whether the end event has passed (then the work is finished and lets
  // go of its tensors); never blocks.
  bool poll();
  // Finishes the work with `error` (the first error wins); its future too, if it was not
  // completed at enqueue. The tensors stay held: see gpu_done().
  void fail(std::exception_ptr error);
  // Whether nothing of the work is left queued on the GPU (its end event has passed, or it
  // never reached NCCL). After a failure the watchdog holds the work until then: kernels
  // queued before the abort still run, and must not find their memory given away.
  bool gpu_done() const;
  bool past_deadline(nccl::Clock::time_point now) const { return recorded_ && now > deadline_; }
  const std::shared_ptr<nccl::Communicator>& comm() const { return comm_; }
  const std::string& name() const { return name_; }
  uint64_t seq() const { return seq_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  void throw_if_failed();

  const std::string name_;
  const uint64_t seq_;
  const at::Device device_;
  std::vector<at::Tensor> inputs_, outputs_;
  std::shared_ptr<nccl::Communicator> comm_;
  const std::chrono::milliseconds timeout_;
  CudaEvent end_;
  // Set once by the enqueuing thread (after a coalescing block's ncclGroupEnd, for the works
  // issued inside it); deadline_ is written before it.
  std::atomic<bool> recorded_{false};
  nccl::Clock::time_point deadline_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace torchpar
