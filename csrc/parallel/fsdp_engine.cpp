#include "parallel/fsdp_engine.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>

namespace torchpar::parallel {

namespace autograd = torch::autograd;

namespace {

// A forward that runs inside backward is activation checkpointing's recomputation: the tensors it
// saves are read by the backward running now, so its unit must stay gathered until that unit's
// backward is done, and it is no new step.
bool in_backward() { return autograd::get_current_graph_task_id() != -1; }

}  // namespace

FsdpEngine::FsdpEngine(std::vector<std::shared_ptr<FlatParam>> units, int64_t root) : root_(root) {
  TORCH_CHECK(root >= 0 && static_cast<size_t>(root) < units.size(), "torchpar fully_shard: root unit ", root,
              " out of range");
  position_.assign(units.size(), -1);
  for (size_t u = 0; u < units.size(); ++u) {
    Unit unit;
    unit.flat = std::move(units[u]);
    const auto& params = unit.flat->unsharded_params();
    TORCH_CHECK(params.size() == unit.flat->size(), "torchpar fully_shard: unit ", u, " is not bound");
    unit.trained = std::any_of(params.begin(), params.end(), [](const at::Tensor& p) { return p.requires_grad(); });
    units_.push_back(std::move(unit));
  }
}

void FsdpEngine::record(FsdpEvent::Kind kind, int64_t unit) {
  trace_.push_back({kind, unit});
  const FsdpMemory now = memory_locked();
  if (now.total() > peak_.total()) {
    peak_ = now;
  }
}

void FsdpEngine::begin_step_locked() {
  trace_.clear();
  // What a backward that raised left behind (its finalize never ran): a reduce-scatter in flight,
  // gradients on the gathered parameters, units still gathered. Its gradients are dropped (the
  // caller skipped that batch), not added into this step's; the reduce-scatter is waited on, as
  // every rank launched it.
  if (in_flight_.work) {
    in_flight_.work->wait();
    in_flight_ = InFlight{};
  }
  for (size_t v = 0; v < units_.size(); ++v) {
    units_[v].flat->discard_unsharded_grads();
    reshard_locked(static_cast<int64_t>(v));
  }
  // A forward whose backward never ran (or a forward under no_grad) leaves nothing to reduce.
  for (auto& u : units_) {
    u.needs_backward = false;
    u.ran_forward = false;
    u.nodes = u.pending = 0;
  }
  backward_queued_ = false;
}

int64_t FsdpEngine::neighbour(int64_t unit, int step) const {
  if (!order_recorded_ || position_[unit] < 0) {
    return -1;
  }
  const int64_t at = position_[unit] + step;
  return at >= 0 && at < static_cast<int64_t>(order_.size()) ? order_[at] : -1;
}

void FsdpEngine::unshard_locked(int64_t unit) {
  FlatParam& flat = *units_[unit].flat;
  if (!flat.gather_in_flight() && !flat.gathered()) {
    flat.start_gather();
    record(FsdpEvent::kGatherLaunch, unit);
  }
  if (flat.gather_in_flight()) {
    flat.wait_gather();
    record(FsdpEvent::kGatherWait, unit);
  }
}

void FsdpEngine::prefetch_locked(int64_t unit) {
  if (unit < 0) {
    return;
  }
  FlatParam& flat = *units_[unit].flat;
  if (!flat.gather_in_flight() && !flat.gathered()) {
    flat.start_gather();
    record(FsdpEvent::kGatherLaunch, unit);
  }
}

void FsdpEngine::reshard_locked(int64_t unit) {
  FlatParam& flat = *units_[unit].flat;
  if (flat.gather_in_flight()) {  // prefetched, then not used
    flat.wait_gather();
    record(FsdpEvent::kGatherWait, unit);
  }
  if (flat.padded_numel() > 0 && flat.gathered()) {
    flat.free_full();
    record(FsdpEvent::kReshard, unit);
  }
}

void FsdpEngine::pre_forward(int64_t unit, bool grad_enabled) {
  std::lock_guard<std::mutex> lock(mutex_);
  // A no_grad forward between a forward and its backward (an evaluation, a metric) starts no step:
  // the pending backward still has its units to reduce.
  const bool pending = std::any_of(units_.begin(), units_.end(), [](const Unit& u) { return u.needs_backward; });
  if (unit == root_ && !in_backward() && (grad_enabled || !pending)) {
    begin_step_locked();
  }
  record(FsdpEvent::kPreForward, unit);
  if (!order_recorded_ && position_[unit] < 0) {
    position_[unit] = static_cast<int64_t>(order_.size());
    order_.push_back(unit);
  }
  unshard_locked(unit);
  // The next unit's parameters travel while this one computes (from the second step, once the
  // order is known). Not in a recomputation inside backward: the next unit's backward is over.
  if (!in_backward()) {
    prefetch_locked(neighbour(unit, +1));
  }
  (void)grad_enabled;
}

bool FsdpEngine::post_forward(int64_t unit, bool grad_enabled) {
  std::lock_guard<std::mutex> lock(mutex_);
  record(FsdpEvent::kPostForward, unit);
  Unit& u = units_[unit];
  if (grad_enabled && u.trained) {  // nothing to reduce for frozen units
    u.needs_backward = true;
    u.ran_forward = true;
  }
  if (in_backward()) {
    return false;  // recomputation (checkpointing): its backward reads these parameters next
  }
  if (unit == root_) {
    order_recorded_ = true;
    if (!grad_enabled) {  // no backward follows: nothing stays gathered
      for (size_t v = 0; v < units_.size(); ++v) reshard_locked(static_cast<int64_t>(v));
      return true;
    }
    return false;  // backward starts with the root's parameters
  }
  if (u.flat->options().reshard_after_forward || !grad_enabled) {
    reshard_locked(unit);
    return true;
  }
  return false;
}

void FsdpEngine::pre_backward(int64_t unit) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!backward_queued_) {
    backward_queued_ = true;
    std::weak_ptr<FsdpEngine> self = weak_from_this();
    autograd::Engine::get_default_engine().queue_callback([self] {
      if (auto engine = self.lock()) engine->finalize();
    });
  }
  record(FsdpEvent::kPreBackward, unit);
  Unit& u = units_[unit];
  if (!u.needs_backward && u.ran_forward) {
    // A further backward over the same graph (retain_graph=True): its gradients are reduced and
    // added to the sharded .grad as the first backward's were.
    u.needs_backward = true;
    u.pending = u.nodes;
  }
  unshard_locked(unit);
  // Backward runs the units in reverse forward order; the root (gathered throughout) comes first,
  // so the unit after it is the last one of forward.
  const int64_t next = unit == root_ ? (order_recorded_ && !order_.empty() ? order_.back() : -1)
                                     : neighbour(unit, -1);
  if (next >= 0 && units_[next].needs_backward) {
    prefetch_locked(next);
  }
}

bool FsdpEngine::register_post_backward(int64_t unit) {
  std::lock_guard<std::mutex> lock(mutex_);
  Unit& u = units_[unit];
  // A recomputation whose forward is already in the graph (non-reentrant checkpointing) makes no
  // node: its graph is only read for saved tensors and never runs backward. A reentrant one's
  // forward ran without grad, so it has none yet, and its backward runs this node.
  if (!u.trained || (in_backward() && u.needs_backward)) {
    return false;
  }
  ++u.nodes;
  ++u.pending;
  return true;
}

void FsdpEngine::post_backward(int64_t unit) {
  std::lock_guard<std::mutex> lock(mutex_);
  Unit& u = units_[unit];
  if (!u.needs_backward) {
    return;  // a backward outside a step this engine runs (nothing to reduce)
  }
  if (u.pending > 0 && --u.pending == 0) {
    post_backward_locked(unit);
  }
}

void FsdpEngine::post_backward_locked(int64_t unit) {
  Unit& u = units_[unit];
  u.needs_backward = false;
  record(FsdpEvent::kPostBackward, unit);
  reshard_locked(unit);  // its backward is done: the gathered parameters go first
  FlatParam& flat = *u.flat;
  if (!flat.requires_grad_sync) {
    flat.accumulate_grads_locally();
    return;
  }
  finish_reduce_scatter_locked();  // one in flight at a time bounds the packed buffers
  at::Tensor packed = flat.take_grads();
  auto [work, out] = flat.start_reduce_scatter(packed);
  in_flight_ = InFlight{unit, std::move(work), std::move(packed), std::move(out)};
  record(FsdpEvent::kReduceScatterLaunch, unit);
}

void FsdpEngine::finish_reduce_scatter_locked() {
  if (!in_flight_.work) {
    return;
  }
  in_flight_.work->wait();
  record(FsdpEvent::kReduceScatterWait, in_flight_.unit);
  InFlight done = std::move(in_flight_);
  in_flight_ = InFlight{};
  done.packed.reset();
  units_[done.unit].flat->deliver_grads(done.out);
}

void FsdpEngine::finalize() {
  std::lock_guard<std::mutex> lock(mutex_);
  // Units the hooks did not complete (a parameter or output without gradient), in backward order,
  // the same on every rank.
  for (auto it = order_.rbegin(); it != order_.rend(); ++it) {
    if (units_[*it].needs_backward) post_backward_locked(*it);
  }
  for (size_t v = 0; v < units_.size(); ++v) {
    if (units_[v].needs_backward) post_backward_locked(static_cast<int64_t>(v));
  }
  finish_reduce_scatter_locked();
  record(FsdpEvent::kFinalize, -1);
  for (size_t v = 0; v < units_.size(); ++v) {
    reshard_locked(static_cast<int64_t>(v));
  }
  backward_queued_ = false;
}

void FsdpEngine::reshard_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t v = 0; v < units_.size(); ++v) {
    reshard_locked(static_cast<int64_t>(v));
  }
}

std::vector<FsdpEvent> FsdpEngine::trace() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return trace_;
}

std::vector<int64_t> FsdpEngine::forward_order() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return order_;
}

FsdpMemory FsdpEngine::memory_locked() const {
  FsdpMemory m;
  std::vector<const void*> seen;
  for (const auto& u : units_) {
    m.shards += u.flat->shard_bytes();
    m.gathered += u.flat->full_bytes();
    m.unsharded_grads += u.flat->unsharded_grad_bytes();
    m.accumulators += u.flat->accumulator_bytes();
    m.sharded_grads += u.flat->sharded_grad_bytes(seen);
  }
  if (in_flight_.work) {
    m.reduce_buffers += static_cast<int64_t>(in_flight_.packed.nbytes() + in_flight_.out.nbytes());
  }
  return m;
}

FsdpMemory FsdpEngine::memory() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return memory_locked();
}

FsdpMemory FsdpEngine::peak_memory() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_;
}

void FsdpEngine::reset_peak_memory() {
  std::lock_guard<std::mutex> lock(mutex_);
  peak_ = memory_locked();
}

}  // namespace torchpar::parallel
