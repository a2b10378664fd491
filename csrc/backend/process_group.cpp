// The c10d surface of the "torchpar" backend: each call checks its arguments and hands the
// collective (backend/ops.h) to the group's queue (backend/queue.h), or posts a
// point-to-point transfer straight to the transport's engine.
#include "backend/process_group.h"

#include <c10/util/Exception.h>

#include <utility>

#include "backend/cuda.h"
#include "backend/errors.h"
#include "backend/ops.h"
#include "backend/store_rendezvous.h"
#include "backend/tensors.h"
#include "common/error.h"
#include "transport/connect.h"

namespace torchpar {

using c10d::OpType;

ProcessGroupTorchpar::ProcessGroupTorchpar(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                           int size, std::chrono::milliseconds timeout,
                                           std::string group_name)
    : c10d::Backend(rank, size), group_name_(std::move(group_name)), timeout_(timeout), store_(store) {
  rendezvous_ = std::make_unique<StoreRendezvous>(store);
  try {
    transport_ = connect(*rendezvous_, rank, size, config_, timeout);
  } catch (const Error& e) {
    C10_THROW_ERROR(DistBackendError, std::string("torchpar: setting up group '") + group_name_ +
                                          "' failed on rank " + std::to_string(rank) + ": " + e.what());
  }
  queue_ = std::make_unique<CollectiveQueue>(*transport_, config_, rank, size, group_name_);
}

ProcessGroupTorchpar::~ProcessGroupTorchpar() { shutdown(); }

void ProcessGroupTorchpar::shutdown() {
  if (queue_) queue_->stop();  // runs what was already queued, then exits
  if (transport_) {
    transport_->p2p().stop();
    // destroy_process_group calls this: a peer still waiting for this rank (a collective it
    // never issued) fails now, not when the last reference to the group goes.
    transport_->leave();
  }
  if (cuda_) cuda_->shutdown();
}

void ProcessGroupTorchpar::abort() { abort("rank " + std::to_string(getRank()) + " aborted group '" + group_name_ + "'"); }

void ProcessGroupTorchpar::abort(const std::string& reason) {
  transport_->abort(reason);
  if (cuda_) cuda_->abort();
  shutdown();
}

void ProcessGroupTorchpar::setTimeout(std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  if (cuda_) cuda_->setTimeout(timeout);
}

c10d::Backend& ProcessGroupTorchpar::cuda() {
  {
    std::lock_guard<std::mutex> lock(cuda_mu_);
    if (!cuda_) cuda_ = make_cuda_backend(store_, getRank(), getSize(), timeout_, group_name_);
  }
  if (coalescing_ && !cuda_in_block_) {
    TORCH_CHECK(coalesced_.empty(), "torchpar: a coalescing block mixes CPU and CUDA operations; ",
                "coalesce the operations of one device");
    cuda_->startCoalescing();
    cuda_in_block_ = true;
  }
  return *cuda_;
}

void ProcessGroupTorchpar::check_cpu_in_block(const char* op) const {
  TORCH_CHECK(!cuda_in_block_, "torchpar ", op, ": a coalescing block mixes CPU and CUDA operations; ",
              "coalesce the operations of one device");
}

std::chrono::milliseconds ProcessGroupTorchpar::timeout_for(std::chrono::milliseconds requested) const {
  return requested == c10d::kUnsetTimeout ? timeout_ : requested;
}

// ---------------------------------------------------------------------------------------
// Collectives

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::broadcast(std::vector<at::Tensor>& tensors,
                                                               const c10d::BroadcastOptions& opts) {
  if (on_cuda("broadcast", tensors)) return cuda().broadcast(tensors, opts);
  return submit<ops::Broadcast>(opts, tensors);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::allreduce(std::vector<at::Tensor>& tensors,
                                                               const c10d::AllreduceOptions& opts) {
  if (on_cuda("all_reduce", tensors)) return cuda().allreduce(tensors, opts);
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].is_sparse()) {
    return submit<ops::SparseAllreduce>(opts, tensors);
  }
  return submit<ops::Allreduce>(opts, tensors);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  if (on_cuda("all_reduce_coalesced", tensors)) return cuda().allreduce_coalesced(tensors, opts);
  return submit<ops::AllreduceCoalesced>(opts, tensors);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::reduce(std::vector<at::Tensor>& tensors,
                                                            const c10d::ReduceOptions& opts) {
  if (on_cuda("reduce", tensors)) return cuda().reduce(tensors, opts);
  return submit<ops::Reduce>(opts, tensors);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                               std::vector<at::Tensor>& inputs,
                                                               const c10d::AllgatherOptions& opts) {
  if (on_cuda("all_gather", outputs, inputs)) return cuda().allgather(outputs, inputs, opts);
  return submit<ops::Allgather>(opts, outputs, inputs);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                     const c10d::AllgatherOptions& opts) {
  if (on_cuda("all_gather_into_tensor", output, input)) return cuda()._allgather_base(output, input, opts);
  return submit<ops::AllgatherIntoTensor>(opts, output, input);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::GatherOptions& opts) {
  if (on_cuda("gather", outputs, inputs)) return cuda().gather(outputs, inputs, opts);
  return submit<ops::Gather>(opts, outputs, inputs);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::scatter(std::vector<at::Tensor>& outputs,
                                                             std::vector<std::vector<at::Tensor>>& inputs,
                                                             const c10d::ScatterOptions& opts) {
  if (on_cuda("scatter", outputs, inputs)) return cuda().scatter(outputs, inputs, opts);
  return submit<ops::Scatter>(opts, outputs, inputs);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  if (on_cuda("reduce_scatter", outputs, inputs)) return cuda().reduce_scatter(outputs, inputs, opts);
  return submit<ops::ReduceScatter>(opts, outputs, inputs);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                          const c10d::ReduceScatterOptions& opts) {
  if (on_cuda("reduce_scatter_tensor", output, input)) return cuda()._reduce_scatter_base(output, input, opts);
  return submit<ops::ReduceScatterTensor>(opts, output, input);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                   std::vector<int64_t>& output_split_sizes,
                                                                   std::vector<int64_t>& input_split_sizes,
                                                                   const c10d::AllToAllOptions& opts) {
  if (on_cuda("all_to_all_single", output, input)) {
    return cuda().alltoall_base(output, input, output_split_sizes, input_split_sizes, opts);
  }
  return submit<ops::AlltoallSingle>(opts, output, input, output_split_sizes, input_split_sizes);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::alltoall(std::vector<at::Tensor>& outputs,
                                                              std::vector<at::Tensor>& inputs,
                                                              const c10d::AllToAllOptions& opts) {
  if (on_cuda("all_to_all", outputs, inputs)) return cuda().alltoall(outputs, inputs, opts);
  return submit<ops::Alltoall>(opts, outputs, inputs);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::barrier(const c10d::BarrierOptions& opts) {
  return submit<ops::Barrier>(opts);
}

// ---------------------------------------------------------------------------------------
// Coalesced lists: one collective per tensor, one Work for them all

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (on_cuda("all_gather_coalesced", outputs, inputs)) return cuda().allgather_coalesced(outputs, inputs, opts);
  // torch's layout: outputs[r][i] receives rank r's inputs[i] (one inner list per rank).
  TORCH_CHECK(static_cast<int>(outputs.size()) == getSize(), "torchpar all_gather_coalesced: ",
              outputs.size(), " output lists for a group of size ", getSize(),
              "; expected one list per rank, each with one tensor per input");
  for (size_t r = 0; r < outputs.size(); ++r) {
    TORCH_CHECK(outputs[r].size() == inputs.size(), "torchpar all_gather_coalesced: output list ", r, " has ",
                outputs[r].size(), " tensors for ", inputs.size(), " inputs");
  }
  check_tensors(inputs, "all_gather_coalesced", "input");
  for (size_t r = 0; r < outputs.size(); ++r) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      const std::string what = "output[" + std::to_string(r) + "][" + std::to_string(i) + "]";
      check_tensor(outputs[r][i], "all_gather_coalesced", what);
      check_same_type_and_size(inputs[i], outputs[r][i], "all_gather_coalesced", what);
    }
  }
  std::vector<c10::intrusive_ptr<Work>> parts;
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::vector<std::vector<at::Tensor>> o(1);
    for (auto& per_rank : outputs) o[0].push_back(per_rank[i]);
    std::vector<at::Tensor> in{inputs[i]};
    parts.push_back(c10::static_intrusive_pointer_cast<Work>(allgather(o, in, opts)));
  }
  return GroupWork::create(getRank(), parts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  if (on_cuda("all_gather_into_tensor_coalesced", outputs, inputs)) {
    return cuda().allgather_into_tensor_coalesced(outputs, inputs, opts);
  }
  TORCH_CHECK(outputs.size() == inputs.size(), "torchpar all_gather_into_tensor_coalesced: ", outputs.size(),
              " outputs for ", inputs.size(), " inputs");
  std::vector<c10::intrusive_ptr<Work>> parts;
  for (size_t i = 0; i < inputs.size(); ++i) {
    parts.push_back(c10::static_intrusive_pointer_cast<Work>(_allgather_base(outputs[i], inputs[i], opts)));
  }
  return GroupWork::create(getRank(), parts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  if (on_cuda("reduce_scatter_tensor_coalesced", outputs, inputs)) {
    return cuda().reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  }
  TORCH_CHECK(outputs.size() == inputs.size(), "torchpar reduce_scatter_tensor_coalesced: ", outputs.size(),
              " outputs for ", inputs.size(), " inputs");
  std::vector<c10::intrusive_ptr<Work>> parts;
  for (size_t i = 0; i < inputs.size(); ++i) {
    parts.push_back(c10::static_intrusive_pointer_cast<Work>(_reduce_scatter_base(outputs[i], inputs[i], opts)));
  }
  return GroupWork::create(getRank(), parts);
}

void ProcessGroupTorchpar::startCoalescing() {
  TORCH_CHECK(!coalescing_, "torchpar: startCoalescing called twice without endCoalescing");
  coalescing_ = true;
  coalesced_.clear();
  cuda_in_block_ = false;  // the CUDA half's block opens at the first CUDA call (cuda())
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::endCoalescing() {
  TORCH_CHECK(coalescing_, "torchpar: endCoalescing without startCoalescing");
  coalescing_ = false;
  if (std::exchange(cuda_in_block_, false)) return cuda_->endCoalescing();
  return GroupWork::create(getRank(), std::exchange(coalesced_, {}));
}

// ---------------------------------------------------------------------------------------
// Point to point

c10::intrusive_ptr<Work> ProcessGroupTorchpar::post_p2p(bool is_send, at::Tensor& tensor, int peer, int tag) {
  const char* op = is_send ? "send" : "recv";
  check_cpu_in_block(op);
  check_tensor(tensor, op, "tensor");
  if (!is_send) check_writable(tensor, op, "tensor");
  if (peer >= 0) {
    check_rank(peer, getSize(), op, is_send ? "destination" : "source");
    TORCH_CHECK(peer != getRank(), "torchpar ", op, ": rank ", getRank(), " cannot ", op,
                is_send ? " to" : " from", " itself");
  }
  Staged s = is_send ? Staged::input(tensor) : Staged::output(tensor);
  auto work = c10::make_intrusive<Work>(getRank(), is_send ? OpType::SEND : (peer < 0 ? OpType::RECVANYSOURCE : OpType::RECV),
                                        is_send ? "torchpar:send" : "torchpar:recv",
                                        std::vector<at::Tensor>{tensor});
  work->count_waits_in(transport_->p2p().waiters());
  work->released_by_completer();  // the callback below completes it
  uint64_t wire_tag = static_cast<uint32_t>(tag);
  auto deadline = Clock::now() + timeout_;
  size_t bytes = s.count() * s.buffer.element_size();
  std::shared_ptr<Request> req =
      is_send ? transport_->p2p().isend(peer, wire_tag, s.data(), bytes, deadline)
              : transport_->p2p().irecv(peer, wire_tag, s.data(), bytes, deadline);
  std::string group = group_name_;
  int rank = getRank();
  // The callback holds the staged buffer (and so the tensor) alive until the transfer ends.
  req->on_done([work, req, s, is_send, group, rank]() mutable {
    std::exception_ptr error = req->error();
    if (!error) {
      try {
        if (!is_send) {  // (a send has no source: sourceRank() raises on it, as gloo's)
          s.finish();
          work->set_source_rank(req->source());
        }
      } catch (...) {
        error = std::current_exception();
      }
    }
    s = Staged{};  // the tensor, let go of on this thread before the waiter wakes (complete_and_release)
    if (error) {
      error = dist_backend_error(std::string("torchpar ") + (is_send ? "send" : "recv") + " failed on rank " +
                                 std::to_string(rank) + " of group '" + group + "': " + message_of(error));
    }
    Work::complete_and_release(std::move(work), error);
  });
  if (coalescing_) coalesced_.push_back(work);
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  check_single(tensors, "send");
  TORCH_CHECK(dst_rank >= 0, "torchpar send: invalid destination rank ", dst_rank);
  if (on_cuda("send", tensors)) return cuda().send(tensors, dst_rank, tag);
  return post_p2p(true, tensors[0], dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  check_single(tensors, "recv");
  TORCH_CHECK(src_rank >= 0, "torchpar recv: invalid source rank ", src_rank);
  if (on_cuda("recv", tensors)) return cuda().recv(tensors, src_rank, tag);
  return post_p2p(false, tensors[0], src_rank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorchpar::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  check_single(tensors, "recv");
  TORCH_CHECK(!on_cuda("recv", tensors), "torchpar recv: a receive from any source takes CPU tensors; NCCL ",
              "matches a CUDA receive to one named source rank");
  return post_p2p(false, tensors[0], -1, tag);
}

}  // namespace torchpar
