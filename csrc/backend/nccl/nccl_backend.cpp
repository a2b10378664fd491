// NcclBackend's machinery: channels (communicator + stream), launching, coalescing blocks,
// failure. The operations themselves are in nccl_ops.cpp.
#include "backend/nccl/nccl_backend.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include "backend/cuda.h"
#include "backend/errors.h"
#include "backend/store_rendezvous.h"
#include "backend/tensors.h"
#include "backend/work.h"
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
  for (auto& [id, channel] : channels_) channel.comm->abort();
}

void NcclBackend::abort() {
  fail(dist_backend_error("torchpar: rank " + std::to_string(getRank()) + " aborted group '" + group_name_ + "'"));
}

void NcclBackend::fail(std::exception_ptr error) {
  std::vector<std::shared_ptr<nccl::Communicator>> comms;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_) failure_ = error;
    for (auto& [id, channel] : channels_) comms.push_back(channel.comm);
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

namespace {
// A communicator's set-up (NCCL's topology detection, proxy threads, buffers) can take
// seconds on a first use: it gets at least this long, even in a group with a shorter
// timeout for its operations.
constexpr std::chrono::milliseconds kSetupFloor{60000};
}  // namespace

NcclBackend::Channel& NcclBackend::channel(const ChannelKey& id, at::Device device) {
  // One set-up at a time (under setup_mu_, not mu_: fail() must not wait for a set-up).
  std::lock_guard<std::mutex> setup(setup_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = channels_.find(id);
    if (it != channels_.end()) return it->second;
  }
  // Every rank makes its communicators in the same order (its first operation of each kind
  // on each device), so a serial per kind names the store key the ranks meet at.
  const int from = std::get<1>(id), to = std::get<2>(id);
  const bool group = from < 0;
  const std::string kind = group ? "group" : "p2p/" + std::to_string(from) + "-" + std::to_string(to);
  const std::string key = "nccl/" + kind + "/" + std::to_string(made_[kind]++);
  std::shared_ptr<nccl::Communicator> comm;
  try {
    c10::cuda::CUDAGuard device_guard(device);  // NCCL binds the communicator to the current device
    // A point-to-point communicator carries one direction: the sender is its rank 0.
    comm = nccl::Communicator::create(*store_, key, group ? getRank() : (getRank() == from ? 0 : 1),
                                      group ? getSize() : 2, device.index(),
                                      nccl::Clock::now() + std::max(timeout_, kSetupFloor));
  } catch (const std::exception& e) {
    std::rethrow_exception(dist_backend_error("torchpar: setting up NCCL (" + key + ") for group '" + group_name_ +
                                              "' on " + device.str() + " failed on rank " +
                                              std::to_string(getRank()) + ": " + e.what()));
  }
  Channel made{std::move(comm), c10::cuda::getStreamFromPool(false, device.index())};
  std::lock_guard<std::mutex> lock(mu_);
  return channels_.emplace(id, std::move(made)).first->second;
}

NcclBackend::Channel& NcclBackend::group_channel(at::Device device) {
  return channel({device.index(), -1, -1}, device);
}

NcclBackend::Channel& NcclBackend::p2p_channel(at::Device device, int from, int to) {
  return channel({device.index(), from, to}, device);
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
  // The communication stream starts after what the caller's stream has queued so far: the
  // kernels that produce the inputs (and last read the outputs).
  CudaEvent ready;
  ready.record(c10::cuda::getCurrentCUDAStream(device.index()));
  auto work = c10::make_intrusive<NcclWork>(getRank(), type, name, issued_, device, std::move(inputs),
                                            std::move(outputs), channel.comm, timeout_);
  if (coalescing_) {
    // Nothing reaches NCCL before the block ends: bad input later in the block then leaves
    // no NCCL group open, and no communicator is in use between the user's calls.
    TORCH_CHECK(pending_.empty() || pending_.front().channel == &channel, "torchpar ", name,
                ": a coalescing block takes the operations of one GPU; it began on ", pending_.front().device,
                ", not ", device);
    pending_.push_back(Pending{&channel, device, body, work, std::move(ready)});
    return work;
  }
  ready.block(channel.stream);
  try {
    // Staging copies are made on the communication stream, so they are ordered with the
    // NCCL calls and their memory is reused only by later work on that stream.
    c10::cuda::CUDAStreamGuard stream_guard(channel.stream);
    auto lock = channel.comm->lock();
    const nccl::Launch l{*channel.comm, channel.stream.stream(), nccl::Clock::now() + timeout_};
    Then then = body(l);
    if (then) then();
    work->enqueued(channel.stream);
  } catch (...) {
    auto error = dist_backend_error(std::string("torchpar ") + name + " failed on rank " + std::to_string(getRank()) +
                                    " of group '" + group_name_ + "': " + message_of(std::current_exception()) +
                                    " [the group is no longer usable]");
    fail(error);
    std::rethrow_exception(error);
  }
  watchdog_.add(work);
  return work;
}

void NcclBackend::startCoalescing() {
  TORCH_CHECK(!coalescing_, "torchpar: startCoalescing called twice without endCoalescing");
  coalescing_ = true;
  pending_.clear();
}

c10::intrusive_ptr<c10d::Work> NcclBackend::endCoalescing() {
  TORCH_CHECK(coalescing_, "torchpar: endCoalescing without startCoalescing");
  coalescing_ = false;
  auto pending = std::exchange(pending_, {});
  if (pending.empty()) return GroupWork::create(getRank(), {});  // done: nothing to launch
  check_usable();
  Channel& channel = *pending.front().channel;
  const at::Device device = pending.front().device;
  std::vector<at::Tensor> outputs;
  for (auto& p : pending) {
    auto r = p.work->result();
    outputs.insert(outputs.end(), r.begin(), r.end());
  }
  auto block = c10::make_intrusive<NcclWork>(getRank(), OpType::COALESCED, "coalesced", issued_, device,
                                             std::vector<at::Tensor>{}, std::move(outputs), channel.comm, timeout_);
  try {
    c10::cuda::CUDAGuard device_guard(device);
    for (auto& p : pending) p.ready.block(channel.stream);
    c10::cuda::CUDAStreamGuard stream_guard(channel.stream);
    // The block's NCCL group is open only here, under the communicator's lock.
    auto lock = channel.comm->lock();
    const nccl::Launch l{*channel.comm, channel.stream.stream(), nccl::Clock::now() + timeout_};
    std::vector<Then> thens;
    {
      nccl::Group group(l);  // NCCL launches the calls at its end
      for (auto& p : pending) thens.push_back(p.body(l));
    }
    // After ncclGroupEnd: copies back, then the end events. The staging buffers the bodies
    // hold were not freed before the kernels that use them were launched.
    for (auto& then : thens) {
      if (then) then();
    }
    for (auto& p : pending) p.work->enqueued(channel.stream);
    block->enqueued(channel.stream);
  } catch (...) {
    auto error = dist_backend_error("torchpar: a coalescing block failed on rank " + std::to_string(getRank()) +
                                    " of group '" + group_name_ + "': " + message_of(std::current_exception()) +
                                    " [the group is no longer usable]");
    fail(error);
    for (auto& p : pending) p.work->fail(error);
    block->fail(error);
    std::rethrow_exception(error);
  }
  for (auto& p : pending) watchdog_.add(p.work);
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
