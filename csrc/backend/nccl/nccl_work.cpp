#include "backend/nccl/nccl_work.h"

#include <ATen/core/jit_type.h>
#include <c10/cuda/CUDAGuard.h>

#include <thread>

#include "backend/errors.h"

namespace torchpar {

NcclWork::NcclWork(int rank, c10d::OpType type, std::string name, uint64_t seq, at::Device device,
                   std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs,
                   std::shared_ptr<nccl::Communicator> comm, std::chrono::milliseconds timeout)
    : c10d::Work(rank, type, nullptr),
      name_(std::move(name)),
      seq_(seq),
      device_(device),
      inputs_(std::move(inputs)),
      outputs_(std::move(outputs)),
      comm_(std::move(comm)),
      timeout_(timeout),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                       std::vector<c10::Device>{device})) {}

void NcclWork::enqueued(const c10::cuda::CUDAStream& stream) {
  end_.record(stream);
  deadline_ = nccl::Clock::now() + timeout_;
  // A CUDA future records its own event on the current (communication) stream: whoever
  // waits on it is ordered after the collective on the device, not on the host.
  future_->markCompleted(c10::IValue(outputs_));
  recorded_.store(true);
}

bool NcclWork::poll() {
  if (!recorded_.load()) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  if (completed_) return true;
  if (!end_.query()) return false;
  inputs_.clear();  // NCCL is done with them: the allocator may reuse their memory
  completed_ = true;
  cv_.notify_all();
  return true;
}

void NcclWork::fail(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (completed_) return;
    completed_ = true;
    exception_ = error;
    cv_.notify_all();
  }
  // A work that never reached NCCL (a coalescing block that failed) has an open future.
  if (!future_->completed()) future_->setError(error);
}

bool NcclWork::gpu_done() const { return !recorded_.load() || end_.query(); }

void NcclWork::throw_if_failed() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (exception_) std::rethrow_exception(exception_);
}

bool NcclWork::isCompleted() {
  if (poll()) return true;
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_;
}

bool NcclWork::isSuccess() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ && !exception_;
}

bool NcclWork::wait(std::chrono::milliseconds timeout) {
  throw_if_failed();
  TORCH_CHECK(recorded_.load(), "torchpar ", name_, ": wait() on an operation of a coalescing block that has ",
              "not ended yet; wait on the work that ends the block");
  if (timeout != kNoTimeout) {
    // An explicit timeout: the host waits too, at most that long.
    const auto until = nccl::Clock::now() + timeout;
    while (!isCompleted()) {
      if (nccl::Clock::now() >= until) {
        std::rethrow_exception(dist_backend_error("torchpar " + name_ + " (collective #" + std::to_string(seq_) +
                                                  "): Timed out after " + std::to_string(timeout.count()) +
                                                  " ms waiting for the operation"));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    throw_if_failed();
  }
  c10::cuda::CUDAGuard guard(device_);
  end_.block(c10::cuda::getCurrentCUDAStream(device_.index()));
  return true;
}

void NcclWork::synchronize() {
  TORCH_CHECK(recorded_.load(), "torchpar ", name_, ": synchronize() inside a coalescing block");
  // The watchdog fails a work past its deadline, so this loop ends by the group's timeout.
  while (!isCompleted()) std::this_thread::sleep_for(std::chrono::microseconds(200));
  throw_if_failed();
  c10::cuda::CUDAGuard guard(device_);
  end_.block(c10::cuda::getCurrentCUDAStream(device_.index()));
}

}  // namespace torchpar
