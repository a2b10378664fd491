// NcclBackend's machinery: channels (communicator + stream), launching, coalescing blocks,
// failure. The operations themselves are in nccl_ops.cpp.
#include "backend/nccl/nccl_backend.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include "backend/cuda.h"
#include "backend/errors.h"
#include "backend/store_rendezvous.h"
#include "backend/tensors.h"
#include "common/error.h"

namespace torchpar {

using c10d::OpType;

NcclBackend::NcclBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                         std::chrono::milliseconds timeout, std::string group_name)
    : c10d::Backend(rank, size),
      group_name_(std::move(group_name)),
      timeout_(timeout),
      store_(std::make_unique<StoreRendezvous>(store)),
      watchdog_(group_name_, rank, size, [this](std::exception_ptr error) { fail(error); }) {}

NcclBackend::~NcclBackend() { shutdown(); }

void NcclBackend::shutdown() {
  // What is in flight ends first (the watchdog fails it at its timeout if it hangs); then
  // the communicators go. Aborting one with nothing in flight is destroying it.
  watchdog_.drain();
  watchdog_.stop();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [device, channel] : group_channels_) channel.comm->abort();
  for (auto& [key, channel] : pair_channels_) channel.comm->abort();
}

void NcclBackend::abort() {
  fail(dist_backend_error("torchpar: rank " + std::to_string(getRank()) + " aborted group '" + group_name_ + "'"));
}

void NcclBackend::fail(std::exception_ptr error) {
  std::vector<std::shared_ptr<nccl::Communicator>> comms;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_) failure_ = error;
    for (auto& [device, channel] : group_channels_) comms.push_back(channel.comm);
    for (auto& [key, channel] : pair_channels_) comms.push_back(channel.comm);
  }
  // Stops the kernels still waiting on a peer; each communicator's lock waits out a call
  // another thread is making on it.
  for (auto& comm : comms) comm->abort();
  watchdog_.fail_all(error);
}

void NcclBackend::check_usable() {
  std::lock_guard<std::mutex> lock(mu_);
  if (failure_) {
    std::rethrow_exception(dist_backend_error("torchpar: group '" + group_name_ + "' is no longer usable on rank " +
                                              std::to_string(getRank()) + "; it failed earlier: " +
                                              message_of(failure_)));
  }
}

at::Device NcclBackend::device_of(const std::vector<at::Tensor>& tensors, const char* op) {
  check_usable();
  std::optional<at::Device> device;
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    TORCH_CHECK(t.is_cuda(), "torchpar ", op, ": a tensor is on ", t.device(), " among CUDA tensors");
    if (!device) device = t.device();
    TORCH_CHECK(*device == t.device(), "torchpar ", op, ": tensors on ", *device, " and ", t.device(),
                "; one call takes tensors of one GPU");
  }
  TORCH_CHECK(device.has_value(), "torchpar ", op, ": no CUDA tensor to take the device from");
  return *device;
}

NcclBackend::Channel& NcclBackend::group_channel(at::Device device) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = group_channels_.find(device.index());
  if (it != group_channels_.end()) return it->second;
  // Every rank makes its group communicators in the same order (its first collective on each
  // device), so a serial names the store key all of them meet at.
  const std::string key = "nccl/group/" + std::to_string(group_channels_made_++);
  std::shared_ptr<nccl::Communicator> comm;
  try {
    comm = nccl::Communicator::create(*store_, key, getRank(), getSize(), device.index(),
                                      nccl::Clock::now() + timeout_);
  } catch (const std::exception& e) {
    std::rethrow_exception(dist_backend_error("torchpar: setting up NCCL for group '" + group_name_ + "' on " +
                                              device.str() + " failed on rank " + std::to_string(getRank()) +
                                              ": " + e.what()));
  }
  Channel channel{std::move(comm), c10::cuda::getStreamFromPool(false, device.index())};
  return group_channels_.emplace(device.index(), std::move(channel)).first->second;
}

NcclBackend::Channel& NcclBackend::pair_channel(at::Device device, int peer) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto id = std::make_pair(static_cast<int>(device.index()), peer);
  auto it = pair_channels_.find(id);
  if (it != pair_channels_.end()) return it->second;
  // The two ranks of a pair meet at a key both can name; the lower rank is the
  // communicator's rank 0 and makes the unique id.
  const int lo = std::min(getRank(), peer), hi = std::max(getRank(), peer);
  const std::string key = "nccl/pair/" + std::to_string(lo) + "-" + std::to_string(hi);
  std::shared_ptr<nccl::Communicator> comm;
  try {
    comm = nccl::Communicator::create(*store_, key, getRank() == lo ? 0 : 1, 2, device.index(),
                                      nccl::Clock::now() + timeout_);
  } catch (const std::exception& e) {
    std::rethrow_exception(dist_backend_error("torchpar: setting up NCCL between ranks " + std::to_string(lo) +
                                              " and " + std::to_string(hi) + " of group '" + group_name_ +
                                              "' failed: " + e.what()));
  }
  Channel channel{std::move(comm), c10::cuda::getStreamFromPool(false, device.index())};
  return pair_channels_.emplace(id, std::move(channel)).first->second;
}

c10::intrusive_ptr<c10d::Work> NcclBackend::collective(OpType type, const char* name, std::vector<at::Tensor> inputs,
                                                       std::vector<at::Tensor> outputs, const Body& body) {
  std::vector<at::Tensor> all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  at::Device device = device_of(all, name);
  ++issued_;
  return launch(group_channel(device), device, type, name, std::move(inputs), std::move(outputs), body);
}

c10::intrusive_ptr<c10d::Work> NcclBackend::launch(Channel& channel, at::Device device, OpType type,
                                                   const char* name, std::vector<at::Tensor> inputs,
                                                   std::vector<at::Tensor> outputs, const Body& body) {
  c10::cuda::CUDAGuard device_guard(device);
  if (coalescing_) {
    TORCH_CHECK(coalesced_channel_ == nullptr || coalesced_channel_ == &channel, "torchpar ", name,
                ": a coalescing block takes the operations of one GPU; it began on ", coalesced_device_, ", not ",
                device);
  }
  // The communication stream starts after what the caller's stream has queued so far: the
  // kernels that produce the inputs (and last read the outputs).
  CudaEvent ready;
  ready.record(c10::cuda::getCurrentCUDAStream(device.index()));
  ready.block(channel.stream);
  auto work = c10::make_intrusive<NcclWork>(getRank(), type, name, issued_, device, std::move(inputs),
                                            std::move(outputs), channel.comm, timeout_);
  try {
    // Staging copies are made on the communication stream, so they are ordered with the
    // NCCL calls and their memory is reused only by later work on that stream.
    c10::cuda::CUDAStreamGuard stream_guard(channel.stream);
    auto lock = channel.comm->lock();
    const nccl::Launch l{*channel.comm, channel.stream.stream(), nccl::Clock::now() + timeout_};
    if (coalescing_ && coalesced_channel_ == nullptr) {
      channel.comm->check(ncclGroupStart(), "ncclGroupStart", l.deadline);
      coalesced_channel_ = &channel;
      coalesced_device_ = device;
    }
    Then then = body(l);
    if (coalescing_) {
      // NCCL launches the block's calls at ncclGroupEnd: what follows them waits till then.
      coalesced_then_.push_back(std::move(then));
      coalesced_.push_back(work);
      return work;
    }
    if (then) then();
    work->enqueued(channel.stream);
  } catch (...) {
    auto error = dist_backend_error(std::string("torchpar ") + name + " failed on rank " + std::to_string(getRank()) +
                                    " of group '" + group_name_ + "': " + message_of(std::current_exception()) +
                                    " [the group is no longer usable]");
    if (coalescing_ && coalesced_channel_ != nullptr) ncclGroupEnd();  // closes this thread's group
    coalescing_ = false;
    coalesced_channel_ = nullptr;
    coalesced_.clear();
    coalesced_then_.clear();
    fail(error);
    std::rethrow_exception(error);
  }
  watchdog_.add(work);
  return work;
}

void NcclBackend::startCoalescing() {
  TORCH_CHECK(!coalescing_, "torchpar: startCoalescing called twice without endCoalescing");
  coalescing_ = true;
  coalesced_channel_ = nullptr;
}

c10::intrusive_ptr<c10d::Work> NcclBackend::endCoalescing() {
  TORCH_CHECK(coalescing_, "torchpar: endCoalescing without startCoalescing");
  coalescing_ = false;
  auto works = std::exchange(coalesced_, {});
  auto thens = std::exchange(coalesced_then_, {});
  Channel* channel = std::exchange(coalesced_channel_, nullptr);
  if (channel == nullptr) return nullptr;  // no CUDA operation in the block
  std::vector<at::Tensor> outputs;
  for (auto& w : works) {
    auto r = w->result();
    outputs.insert(outputs.end(), r.begin(), r.end());
  }
  auto block = c10::make_intrusive<NcclWork>(getRank(), OpType::COALESCED, "coalesced", issued_, coalesced_device_,
                                             std::vector<at::Tensor>{}, std::move(outputs), channel->comm, timeout_);
  try {
    c10::cuda::CUDAGuard device_guard(coalesced_device_);
    c10::cuda::CUDAStreamGuard stream_guard(channel->stream);
    auto lock = channel->comm->lock();
    channel->comm->check(ncclGroupEnd(), "ncclGroupEnd", nccl::Clock::now() + timeout_);
    for (auto& then : thens) {
      if (then) then();
    }
    for (auto& w : works) w->enqueued(channel->stream);
    block->enqueued(channel->stream);
  } catch (...) {
    auto error = dist_backend_error("torchpar: a coalescing block failed on rank " + std::to_string(getRank()) +
                                    " of group '" + group_name_ + "': " + message_of(std::current_exception()) +
                                    " [the group is no longer usable]");
    fail(error);
    for (auto& w : works) w->fail(error);
    std::rethrow_exception(error);
  }
  for (auto& w : works) watchdog_.add(w);
  watchdog_.add(block);
  return block;
}

}  // namespace torchpar

namespace torchpar {

c10::intrusive_ptr<c10d::Backend> make_cuda_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout, const std::string& group_name) {
  return c10::make_intrusive<NcclBackend>(store, rank, size, timeout, group_name);
}

}  // namespace torchpar
