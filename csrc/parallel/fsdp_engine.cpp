#include "parallel/fsdp_engine.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <cmath>
#include <sstream>

namespace torchpar::parallel {

namespace autograd = torch::autograd;

namespace {

// A forward that runs inside backward is activation checkpointing's recomputation: the tensors it
// saves are read by the backward running now, so its unit must stay gathered until that unit's
// backward is done, and it is no new step.
bool in_backward() { return autograd::get_current_graph_task_id() != -1; }

// A reduce-scatter's unit tag: exact in the reduce dtype (bfloat16 holds integers up to 256).
double unit_tag(int64_t unit, at::ScalarType dtype) {
  const bool half = dtype == at::kHalf || dtype == at::kBFloat16;
  return 1.0 + static_cast<double>(half ? unit % 255 : unit);
}

}  // namespace

FsdpEngine::FsdpEngine(std::vector<std::shared_ptr<FlatParam>> units, int64_t root) : root_(root) {
  TORCH_CHECK(root >= 0 && static_cast<size_t>(root) < units.size(), "torchpar fully_shard: root unit ", root,
              " out of range");
  position_.assign(units.size(), -1);
  for (size_t u = 0; u < units.size(); ++u) {
    stream_.push_back(static_cast<int64_t>(u));
    stream_pos_.push_back(static_cast<int64_t>(u));
  }
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

void FsdpEngine::begin_step_locked(const std::vector<bool>& keep) {
  trace_.clear();
  // What a backward that raised left behind (its finalize never ran): a reduce-scatter in flight,
  // gradients on the gathered parameters, units still gathered. Its gradients are dropped (the
  // caller skipped that batch), not added into this step's; the reduce-scatter is waited on, as
  // every rank launched it.
  for (InFlight* f : {&in_flight_, &all_reduce_}) {
    if (f->work) {
      f->work->wait();
      *f = InFlight{};
    }
  }
  for (size_t v = 0; v < units_.size(); ++v) {
    units_[v].flat->discard_unsharded_grads();
    if (!keep[v]) reshard_locked(static_cast<int64_t>(v));
  }
  // A forward whose backward never ran (or a forward under no_grad) leaves nothing to reduce.
  forget_step_locked();
}

void FsdpEngine::forget_step_locked() {
  for (auto& u : units_) {
    u.needs_backward = false;
    u.ran_forward = false;
    u.ran = false;
    u.slot_done = false;
    u.nodes = u.pending = 0;
  }
  backward_queued_ = false;
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

void FsdpEngine::reshard_locked(int64_t unit, bool after_forward) {
  FlatParam& flat = *units_[unit].flat;
  if (flat.gather_in_flight()) {  // prefetched, then not used
    flat.wait_gather();
    record(FsdpEvent::kGatherWait, unit);
  }
  if (flat.padded_numel() > 0 && flat.gathered()) {
    if (after_forward && flat.post_forward_group()) {
      flat.free_full_to_post_forward();
      record(FsdpEvent::kReshardToPostForward, unit);
      return;
    }
    flat.free_full();
    record(FsdpEvent::kReshard, unit);
  }
  if (!after_forward) {  // (in forward, a unit freed already keeps the slice it was freed to)
    flat.drop_post_forward();
  }
}

FsdpEngine::StepStart FsdpEngine::agree_step_start_locked(bool grad_enabled, bool pending) {
  StepStart start;
  start.keep.assign(units_.size(), false);
  start.begin = grad_enabled || !pending;
  // Units FSDPModule.unshard() gathered for this step: kept without asking, as every rank that
  // unshards does so alike (the user's contract; the all-gathers would not pair otherwise).
  std::vector<bool> requested(units_.size(), false);
  for (size_t v = 0; v < units_.size(); ++v) {
    FlatParam& flat = *units_[v].flat;
    requested[v] = flat.unshard_requested && flat.gather_is_current();
    start.keep[v] = requested[v];
    flat.unshard_requested = false;
  }
  // Only where the program asks for keeping (a unit set not to reshard after backward), the same
  // on every rank: then every rank runs this all-reduce; otherwise the decisions stay local and a
  // step begins sharded, as it always did.
  const bool asked = std::any_of(units_.begin(), units_.end(),
                                 [](const Unit& u) { return !u.flat->reshard_after_backward; });
  if (!asked) {
    return start;
  }
  // One MIN all-reduce of [the units this rank offers to keep..., whether its backward is still
  // pending]. A unit is kept where every rank offers it. A no_grad forward begins no step while
  // a backward is pending, but "pending" is local: a backward that raised on one rank before
  // reaching the model leaves it pending there only, so a step begins if any rank's backward
  // completed (review finding).
  const bool clean = !backward_queued_;  // a backward that raised on this rank keeps nothing
  const int64_t n = static_cast<int64_t>(units_.size());
  at::Tensor mine = at::zeros({n + 1}, at::TensorOptions().dtype(at::kInt));
  for (int64_t v = 0; v < n; ++v) {
    const FlatParam& flat = *units_[v].flat;
    if (requested[v] ||
        (clean && !flat.reshard_after_backward && flat.padded_numel() > 0 && flat.gathered_and_current())) {
      mine[v] = 1;
    }
  }
  mine[n] = pending ? 1 : 0;
  const auto& root = *units_[root_].flat;
  std::vector<at::Tensor> tensors{mine.to(root.device())};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MIN;
  root.group()->allreduce(tensors, opts)->wait();
  at::Tensor agreed = tensors[0].cpu();
  for (int64_t v = 0; v < n; ++v) start.keep[v] = agreed[v].item<int>() != 0;
  start.begin = grad_enabled || agreed[n].item<int>() == 0;
  return start;
}

bool FsdpEngine::keeps_after_backward(int64_t unit) const {
  const FlatParam& flat = *units_[unit].flat;
  return !flat.reshard_after_backward && !flat.requires_grad_sync;
}

void FsdpEngine::release_after_backward_locked(int64_t unit) {
  if (!keeps_after_backward(unit)) {
    reshard_locked(unit);
  }
}

void FsdpEngine::pre_forward(int64_t unit, bool grad_enabled) {
  std::lock_guard<std::mutex> lock(mutex_);
  // A no_grad forward between a forward and its backward (an evaluation, a metric) starts no step:
  // the pending backward still has its units to reduce.
  // A backward that began and never finished (it raised, maybe on this rank only) is no longer
  // pending: the step begins as on the ranks whose backward completed (review finding).
  const bool pending = !backward_queued_ &&
                       std::any_of(units_.begin(), units_.end(), [](const Unit& u) { return u.needs_backward; });
  if (unit == root_ && !in_backward()) {
    const StepStart start = agree_step_start_locked(grad_enabled, pending);
    step_forward_ = start.begin;
    if (step_forward_) {
      begin_step_locked(start.keep);
    } else {
      // A no_grad forward while a backward is pending computes with what is gathered; not with a
      // copy from before an optimizer step or a checkpoint load (review finding). Every rank of a
      // pending backward ran the same program, so every rank frees the same units.
      for (size_t v = 0; v < units_.size(); ++v) {
        const FlatParam& flat = *units_[v].flat;
        if (flat.padded_numel() > 0 && flat.gathered() && !flat.gather_in_flight() && !flat.gathered_and_current()) {
          reshard_locked(static_cast<int64_t>(v));
        }
      }
    }
    cursor_ = 0;
  }
  record(FsdpEvent::kPreForward, unit);
  if (!in_backward()) {
    if (step_forward_) {
      units_[unit].ran = true;  // not in a no_grad forward between this step's forward and backward
    }
    if (!order_recorded_ && position_[unit] < 0) {
      position_[unit] = static_cast<int64_t>(order_.size());
      order_.push_back(unit);
    }
    // The units of the stream before this one that this rank skipped are gathered too: the
    // ranks that run them gather them now.
    if (stream_pos_[unit] >= 0) {
      advance_stream_locked(static_cast<size_t>(stream_pos_[unit]) + 1);
      // And the ones just before it that this rank skipped are freed now: the ranks that ran them
      // have freed them by their post_forward, and holding every skipped unit until the end of
      // forward could gather most of the model at once. Only once the order is agreed: in the
      // first forward the stream is index order, and a unit before this one may still run.
      if (order_recorded_ && step_forward_) {
        for (int64_t at = stream_pos_[unit] - 1; at >= 0 && !units_[stream_[at]].ran; --at) {
          if (units_[stream_[at]].flat->options().reshard_after_forward) reshard_locked(stream_[at], grad_enabled);
        }
      }
    }
  }
  unshard_locked(unit);
  // The next unit's parameters travel while this one computes (from the second step, once the
  // order is known; or the units u lists, from the first). Not in a recomputation inside
  // backward: the next unit's backward is over.
  if (!in_backward()) {
    advance_stream_locked(forward_prefetch_end_locked(unit));
  }
}

size_t FsdpEngine::forward_prefetch_end_locked(int64_t unit) const {
  const auto& listed = units_[unit].forward_prefetch;
  if (!listed) {
    return order_recorded_ ? cursor_ + 1 : cursor_;
  }
  size_t end = cursor_;
  for (int64_t t : *listed) {
    if (stream_pos_[t] >= 0) end = std::max(end, static_cast<size_t>(stream_pos_[t]) + 1);
  }
  return end;
}

void FsdpEngine::prefetch_in_backward_locked(int64_t unit) {
  int64_t next = backward_next(unit);
  const auto& listed = units_[unit].backward_prefetch;
  if (!listed) {
    if (next >= 0 && gathers_in_backward(next)) prefetch_locked(next);
    return;
  }
  // The furthest listed unit along backward order: the lowest position in the agreed forward order.
  int64_t stop = -1;
  for (int64_t t : *listed) {
    if (t != root_ && position_[t] >= 0 && (stop < 0 || position_[t] < stop)) stop = position_[t];
  }
  for (; stop >= 0 && next >= 0 && position_[next] >= stop; next = backward_next(next)) {
    if (gathers_in_backward(next)) prefetch_locked(next);
  }
}

bool FsdpEngine::gathers_in_backward(int64_t unit) const {
  const Unit& u = units_[unit];
  return u.trained && !u.slot_done && u.flat->unshard_in_backward;
}

void FsdpEngine::check_unit(int64_t unit) const {
  TORCH_CHECK(unit >= 0 && static_cast<size_t>(unit) < units_.size(), "torchpar fully_shard: unit ", unit,
              " out of range");
}

void FsdpEngine::unshard(int64_t unit) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_unit(unit);
  FlatParam& flat = *units_[unit].flat;
  if (flat.gathered() && !flat.gather_is_current()) {
    reshard_locked(unit);  // kept from before a load or an optimizer step: the user reads it next (review)
  }
  flat.unshard_requested = true;
  prefetch_locked(unit);
}

void FsdpEngine::wait_unshard(int64_t unit) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_unit(unit);
  FlatParam& flat = *units_[unit].flat;
  if (flat.gather_in_flight()) {  // (not a gather of its own: a handle waited on late issues nothing)
    flat.wait_gather();
    record(FsdpEvent::kGatherWait, unit);
  }
}

void FsdpEngine::set_forward_prefetch(int64_t unit, std::optional<std::vector<int64_t>> targets) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_unit(unit);
  for (int64_t t : targets.value_or(std::vector<int64_t>{})) check_unit(t);
  units_[unit].forward_prefetch = std::move(targets);
}

void FsdpEngine::set_backward_prefetch(int64_t unit, std::optional<std::vector<int64_t>> targets) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_unit(unit);
  for (int64_t t : targets.value_or(std::vector<int64_t>{})) check_unit(t);
  units_[unit].backward_prefetch = std::move(targets);
}

void FsdpEngine::advance_stream_locked(size_t to) {
  for (to = std::min(to, stream_.size()); cursor_ < to; ++cursor_) {
    prefetch_locked(stream_[cursor_]);
  }
}

void FsdpEngine::agree_order_locked() {
  // Once, at the end of the first forward: every rank's recorded order, so that the stream and
  // the backward order are the same on every rank even where their forwards ran different units.
  const FlatParam& root = *units_[root_].flat;
  const int64_t n = static_cast<int64_t>(units_.size());
  at::Tensor mine = at::full({n}, -1, at::TensorOptions().dtype(at::kLong));
  for (size_t i = 0; i < order_.size(); ++i) mine[static_cast<int64_t>(i)] = order_[i];
  at::Tensor all = at::cat(all_gather_each(root.group(), mine.to(root.device())));  // [world * n]
  if (root.replicated()) {
    // Hybrid sharding: every replica's too, so that all of them agree on one order (their
    // all-reduces pair unit by unit); the list of orders is the same on every rank.
    all = at::cat(all_gather_each(root.replicate_group(), all));
  }
  all = all.cpu().contiguous();
  std::vector<std::vector<int64_t>> orders;
  size_t longest = 0;  // the first rank's among the longest
  for (int64_t k = 0; k * n < all.numel(); ++k) {
    const int64_t* v = all.data_ptr<int64_t>() + k * n;
    std::vector<int64_t> o;
    for (int64_t i = 0; i < n && v[i] >= 0; ++i) o.push_back(v[i]);
    if (!orders.empty() && o.size() > orders[longest].size()) {
      longest = orders.size();
    }
    orders.push_back(std::move(o));
  }
  // Preference: the longest order, then the units only other ranks ran, as they come.
  std::vector<int64_t> preferred = orders[longest];
  std::vector<int64_t> rank_of(units_.size(), -1);
  for (size_t i = 0; i < preferred.size(); ++i) rank_of[preferred[i]] = static_cast<int64_t>(i);
  for (const auto& o : orders) {
    for (int64_t u : o) {
      if (rank_of[u] < 0) {
        rank_of[u] = static_cast<int64_t>(preferred.size());
        preferred.push_back(u);
      }
    }
  }
  // Every rank's order kept (a unit after each unit it follows on some rank), so that two ranks
  // that each skipped a different unit both find their own order in the agreed one: repeatedly
  // the most preferred unit whose predecessors are placed. Orders that contradict each other (data-
  // dependent) have no such unit at some point: the most preferred one left goes next, and the
  // reduce-scatter tags catch what then pairs wrongly.
  std::vector<std::vector<int64_t>> after(units_.size());  // unit -> the units it follows somewhere
  for (const auto& o : orders) {
    for (size_t i = 1; i < o.size(); ++i) after[o[i]].push_back(o[i - 1]);
  }
  std::vector<int64_t> agreed, pos(units_.size(), -1);
  while (agreed.size() < preferred.size()) {
    int64_t pick = -1;
    for (int64_t u : preferred) {
      if (pos[u] >= 0) continue;
      if (pick < 0) pick = u;  // the fallback
      if (std::all_of(after[u].begin(), after[u].end(), [&](int64_t p) { return pos[p] >= 0; })) {
        pick = u;
        break;
      }
    }
    pos[pick] = static_cast<int64_t>(agreed.size());
    agreed.push_back(pick);
  }
  order_ = agreed;
  position_ = pos;
  stream_ = agreed;
  stream_pos_ = pos;
  cursor_ = stream_.size();
  order_recorded_ = true;
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
    advance_stream_locked(stream_.size());  // the units after the last one this rank ran
    if (!order_recorded_) {
      agree_order_locked();
    }
    if (!grad_enabled) {  // no backward follows: nothing stays gathered
      for (size_t v = 0; v < units_.size(); ++v) reshard_locked(static_cast<int64_t>(v));
      return true;
    }
    // Units gathered for the stream only, freed as the ranks that ran them freed them (to the
    // same post-forward slices: their backward gathers those).
    for (size_t v = 0; v < units_.size(); ++v) {
      if (!units_[v].ran && units_[v].flat->options().reshard_after_forward) {
        reshard_locked(static_cast<int64_t>(v), true);
      }
    }
    return false;  // backward starts with the root's parameters
  }
  if (u.flat->options().reshard_after_forward || !grad_enabled) {
    reshard_locked(unit, grad_enabled);  // a backward follows: keep the post-forward slice, if any
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
    for (auto& u : units_) u.slot_done = false;
  }
  record(FsdpEvent::kPreBackward, unit);
  Unit& u = units_[unit];
  if (!u.needs_backward && u.ran_forward) {
    // A further backward over the same graph (retain_graph=True): its gradients are reduced and
    // added to the sharded .grad as the first backward's were.
    u.needs_backward = true;
    u.pending = u.nodes;
  }
  if (u.flat->unshard_in_backward) {
    unshard_locked(unit);
  }
  // Backward runs the units in reverse forward order; the root (gathered throughout) comes first,
  // so the unit after it is the last one of forward. Prefetched whether or not this rank ran it
  // (the others may have): the same on every rank.
  prefetch_in_backward_locked(unit);
  // The root's backward starts with the units after it; a unit with no post-backward node (frozen,
  // or inputs without grad) has no more collectives in its place.
  if (unit == root_ || u.nodes == 0) {
    complete_slot_locked(unit);
  }
}

int64_t FsdpEngine::backward_next(int64_t unit) const {
  if (!order_recorded_) {
    return -1;
  }
  int64_t at = unit == root_ ? static_cast<int64_t>(order_.size()) : position_[unit];
  if (at < 0) {
    return -1;
  }
  for (--at; at >= 0; --at) {
    if (order_[at] != root_) return order_[at];
  }
  return -1;
}

bool FsdpEngine::skipped(int64_t unit) const {
  return order_recorded_ && unit != root_ && position_[unit] >= 0 && !units_[unit].ran;
}

void FsdpEngine::complete_slot_locked(int64_t unit) {
  units_[unit].slot_done = true;
  const int64_t next = backward_next(unit);
  if (next >= 0 && skipped(next) && !units_[next].slot_done) {
    skipped_backward_locked(next);
  }
}

void FsdpEngine::skipped_backward_locked(int64_t unit) {
  // What a rank that ran `unit` does in its pre_backward and post_backward, with no gradient of
  // its own: the same collectives at the same place (after the unit before it in backward order).
  record(FsdpEvent::kSkippedBackward, unit);
  Unit& u = units_[unit];
  prefetch_locked(unit);
  prefetch_in_backward_locked(unit);
  if (u.trained) {
    release_after_backward_locked(unit);
    if (u.flat->requires_grad_sync) {
      start_reduce_scatter_locked(unit, u.flat->has_accumulator());
    }
  }
  complete_slot_locked(unit);
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
  release_after_backward_locked(unit);  // its backward is done: the gathered parameters go first
  FlatParam& flat = *u.flat;
  if (!flat.requires_grad_sync) {
    flat.accumulate_grads_locally();
    complete_slot_locked(unit);
    return;
  }
  start_reduce_scatter_locked(unit, true);
  complete_slot_locked(unit);
}

void FsdpEngine::start_reduce_scatter_locked(int64_t unit, bool real_grads) {
  FlatParam& flat = *units_[unit].flat;
  finish_reduce_scatter_locked();  // one in flight at a time bounds the packed buffers
  at::Tensor packed = flat.take_grads();
  // Negative: this rank had no gradient for the unit (it skipped its forward).
  const double tag = unit_tag(unit, flat.reduce_dtype()) * (real_grads ? 1.0 : -1.0);
  auto [work, out] = flat.start_reduce_scatter(packed, tag);
  in_flight_ = InFlight{unit, std::move(work), std::move(packed), std::move(out)};
  record(FsdpEvent::kReduceScatterLaunch, unit);
}

std::string FsdpEngine::describe_tag(double tag) const {
  std::ostringstream out;
  if (tag == 0 || std::fabs(tag) != std::floor(std::fabs(tag))) {
    out << "something else (tag " << tag << ")";
    return out.str();
  }
  const int64_t other = static_cast<int64_t>(std::fabs(tag)) - 1;
  out << "unit " << other;
  if (other >= 0 && other < static_cast<int64_t>(units_.size()) && units_[other].flat->size()) {
    out << " ('" << units_[other].flat->name(0) << "', ...)";
  }
  return out.str();
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
  FlatParam& flat = *units_[done.unit].flat;
  const double mine = unit_tag(done.unit, flat.reduce_dtype());
  const std::vector<double> tags = flat.reduced_tags(done.out);
  bool any_grads = false;
  for (size_t r = 0; r < tags.size(); ++r) {
    if (std::fabs(tags[r]) != mine) {
      std::ostringstream msg;
      msg << "torchpar fully_shard: the gradient reduce-scatters of the ranks went out of step: rank "
          << flat.rank() << " reduced unit " << done.unit << " ('" << (flat.size() ? flat.name(0) : "") << "', ...)"
          << " while rank " << r << " reduced " << describe_tag(tags[r])
          << ". The ranks ran their units in orders the engine cannot line up (units whose order "
             "depends on the data, a unit no rank ran in the first step, or a unit run more times on "
             "some ranks than on others); this step's gradients are incomplete: do not step on them.";
      if (flat.replicated()) {
        // The other replicas' shard groups may have paired this unit rightly and wait in its
        // all-reduce: give them one whose tag (0) pairs with nothing, so that they raise too
        // (review finding: they waited, then paired with this replica's next step).
        try {
          flat.start_replica_all_reduce(done.out, false, 0.0)->wait();
        } catch (const std::exception&) {  // this error is the one to raise
        }
      }
      TORCH_CHECK(false, msg.str());
    }
    any_grads = any_grads || tags[r] > 0;
  }
  if (flat.replicated() && !flat.requires_all_reduce) {
    flat.add_partial(done.out);  // summed within the replica; the next all-reduce takes it
  } else if (flat.replicated()) {
    any_grads = flat.take_partial(done.out) || any_grads;
    finish_all_reduce_locked();
    all_reduce_ = InFlight{done.unit, flat.start_replica_all_reduce(done.out, any_grads, mine), {}, done.out};
    record(FsdpEvent::kAllReduceLaunch, done.unit);
  } else if (any_grads) {  // no rank ran the unit: its .grad stays as one process leaves it
    flat.deliver_grads(done.out);
  }
}

void FsdpEngine::finish_all_reduce_locked() {
  if (!all_reduce_.work) {
    return;
  }
  all_reduce_.work->wait();
  record(FsdpEvent::kAllReduceWait, all_reduce_.unit);
  InFlight done = std::move(all_reduce_);
  all_reduce_ = InFlight{};
  FlatParam& flat = *units_[done.unit].flat;
  const double mine = unit_tag(done.unit, flat.reduce_dtype());
  const FlatParam::ReplicaSlots slots = flat.replica_slots(done.out);
  for (size_t r = 0; r < slots.tags.size(); ++r) {
    // Each replica's shard group agreed on its order; the replicas compare theirs here (a unit
    // whose order depends on the data may differ between them).
    TORCH_CHECK(slots.tags[r] == mine, "torchpar fully_shard: the gradient all-reduces across replicas went out "
                "of step: replica ", flat.replica(), " reduced unit ", done.unit, " ('", flat.size() ? flat.name(0) : "",
                "', ...) while replica ", r, " reduced ", describe_tag(slots.tags[r]),
                ". The replicas ran their units in different orders, or one of them failed this unit's "
                "reduce-scatter; this step's gradients are incomplete: do not step on them.");
  }
  if (slots.any_grads) {
    flat.deliver_grads(done.out);
  }
}

void FsdpEngine::finalize() {
  std::lock_guard<std::mutex> lock(mutex_);
  // Units the hooks did not complete (a parameter or output without gradient), and those this
  // rank skipped not done yet, in backward order, the same on every rank.
  for (auto it = order_.rbegin(); it != order_.rend(); ++it) {
    if (skipped(*it) && !units_[*it].slot_done) {
      skipped_backward_locked(*it);
    } else if (units_[*it].needs_backward) {
      post_backward_locked(*it);
    }
  }
  for (size_t v = 0; v < units_.size(); ++v) {
    if (units_[v].needs_backward) post_backward_locked(static_cast<int64_t>(v));
  }
  finish_reduce_scatter_locked();
  finish_all_reduce_locked();
  record(FsdpEvent::kFinalize, -1);
  for (size_t v = 0; v < units_.size(); ++v) {
    if (!keeps_after_backward(static_cast<int64_t>(v))) {
      reshard_locked(static_cast<int64_t>(v));
    }
  }
  backward_queued_ = false;
}

void FsdpEngine::reshard_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t v = 0; v < units_.size(); ++v) {
    reshard_locked(static_cast<int64_t>(v));
  }
}

void FsdpEngine::reset_iter_state() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::exception_ptr failed;  // a collective that failed in flight: raised once the state is reset
  for (InFlight* f : {&in_flight_, &all_reduce_}) {
    if (f->work) {
      try {
        f->work->wait();
      } catch (...) {
        if (!failed) failed = std::current_exception();
      }
      *f = InFlight{};
    }
  }
  for (size_t v = 0; v < units_.size(); ++v) {
    FlatParam& flat = *units_[v].flat;
    if (flat.gather_in_flight()) {
      try {
        flat.wait_gather();
      } catch (...) {
        if (!failed) failed = std::current_exception();
      }
    }
    flat.discard_unsharded_grads();
    flat.set_accumulator(at::Tensor());
    flat.discard_partial();
    flat.unshard_requested = false;
    reshard_locked(static_cast<int64_t>(v));
  }
  forget_step_locked();
  step_forward_ = false;
  if (failed) std::rethrow_exception(failed);
}

void FsdpEngine::reshard(int64_t unit) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(unit >= 0 && static_cast<size_t>(unit) < units_.size(), "torchpar fully_shard: unit ", unit,
              " out of range");
  reshard_locked(unit);
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
  if (all_reduce_.work) {
    m.reduce_buffers += static_cast<int64_t>(all_reduce_.out.nbytes());
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
