#include "parallel/reducer.h"

#include "common/step_buffer.h"
#include "parallel/bucket_assignment.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <functional>
#include <sstream>
#include <unordered_set>

namespace torchpar::parallel {

namespace autograd = torch::autograd;

namespace {

// A pre-hook of a parameter's AccumulateGrad: runs before the new gradient is added into .grad.
class BeforeAccumulation : public autograd::FunctionPreHook {
 public:
  explicit BeforeAccumulation(std::function<void()> fn) : fn_(std::move(fn)) {}
  autograd::variable_list operator()(const autograd::variable_list& grads) override {
    fn_();
    return grads;
  }

 private:
  std::function<void()> fn_;
};

}  // namespace

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                 std::vector<std::vector<int64_t>> buckets,
                 c10::intrusive_ptr<c10d::ProcessGroup> group, ReducerOptions options)
    : params_(std::move(params)), names_(std::move(names)), group_(std::move(group)),
      options_(options) {
  const size_t n = params_.size();
  TORCH_CHECK(group_, "torchpar DDP: the reducer needs a process group");
  TORCH_CHECK(names_.size() == n, "torchpar DDP: ", n, " parameters but ", names_.size(), " names");
  std::unordered_set<const void*> distinct;
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(params_[i].requires_grad() && params_[i].is_leaf(), "torchpar DDP: parameter '",
                names_[i], "' must be a leaf that requires grad");
    // A shared (tied) weight is one parameter; passing it twice would reduce it twice.
    TORCH_CHECK(distinct.insert(params_[i].unsafeGetTensorImpl()).second,
                "torchpar DDP: parameter '", names_[i], "' is listed twice");
  }

  TORCH_CHECK(!options_.shard_gradients || !options_.gradient_as_bucket_view,
              "torchpar DDP: shard_gradients=True keeps gradients in per-rank shards; "
              "gradient_as_bucket_view=True does not apply");
  TORCH_CHECK(options_.sparse.empty() || options_.sparse.size() == n, "torchpar DDP: ",
              options_.sparse.size(), " sparse flags for ", n, " parameters");
  for (size_t i = 0; i < options_.sparse.size(); ++i) {
    TORCH_CHECK(!options_.sparse[i] || !options_.shard_gradients, "torchpar DDP: parameter '", names_[i],
                "' gets sparse gradients (sparse=True), which shard_gradients=True cannot split into "
                "per-rank shards; use sparse=False, or shard_gradients=False");
  }
  build_buckets(buckets);
  rebuilt_ = options_.cap_bytes < 0 || options_.shard_gradients;
  if (options_.shard_gradients) {
    step_buffers_in_huge_pages();  // a bad TORCHPAR_HUGE_PAGES fails here, not in a backward
  }
  ready_.assign(n, false);
  reachable_.assign(n, true);
  used_since_sync_.assign(n, 0);
  hooks_seen_.assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    auto acc = autograd::impl::grad_accumulator(params_[i]);
    TORCH_CHECK(acc, "torchpar DDP: parameter '", names_[i], "' has no gradient accumulator");
    // Post-hooks of AccumulateGrad run after the gradient is in .grad.
    auto hook = std::make_unique<autograd::utils::LambdaPostHook>(
        [this, i](const autograd::variable_list& outputs, const autograd::variable_list&) {
          on_gradient(static_cast<int64_t>(i));
          return outputs;
        });
    hook_keys_.push_back(acc->add_post_hook(std::move(hook)));
    if (options_.shard_gradients) {
      auto before = std::make_unique<BeforeAccumulation>([this, i] { before_accumulation(static_cast<int64_t>(i)); });
      pre_hooks_.push_back(before.get());
      acc->add_pre_hook(std::move(before));
    }
    accumulators_.push_back(std::move(acc));
  }
  handed_.resize(n);
  kept_.resize(n);
  kept_version_.assign(n, 0);
  replaced_by_autograd_.assign(n, false);
}

void Reducer::allocate(Bucket& b) {
  if (b.flat.defined() || b.sparse) {
    return;
  }
  // Zeros: a shard's padding is reduced too. A sharded bucket's buffer lives for one backward,
  // allocated again each step: in huge pages (step_buffer.h).
  b.flat = b.shard_numel ? step_buffer_zeros(b.numel, b.options) : at::zeros({b.numel}, b.options);
  for (size_t k = 0; k < b.params.size(); ++k) {
    const at::Tensor& p = params_[b.params[k]];
    b.views.push_back(b.flat.narrow(0, b.offsets[k], p.numel()).view(p.sizes()));
  }
}

void Reducer::build_buckets(const std::vector<std::vector<int64_t>>& buckets) {
  at::NoGradGuard no_grad;
  const size_t n = params_.size();
  buckets_.clear();
  slots_.assign(n, Slot{SIZE_MAX, 0});
  const int64_t world = group_->getSize();
  std::vector<BucketShards> shards;
  if (options_.shard_gradients) {
    shards = shard_buckets(params_, buckets, world);
  }
  for (size_t bi = 0; bi < buckets.size(); ++bi) {
    // Sharded: the bucket's parameters in shard order (rank by rank), at the shards' offsets.
    const std::vector<int64_t>& indices = shards.empty() ? buckets[bi] : shards[bi].params;
    TORCH_CHECK(!indices.empty(), "torchpar DDP: empty bucket");
    Bucket b;
    const at::Tensor& first = params_.at(indices.front());
    const at::ScalarType dtype = options_.reduce_dtype.value_or(first.scalar_type());
    int64_t numel = 0;
    for (int64_t i : indices) {
      TORCH_CHECK(i >= 0 && static_cast<size_t>(i) < n, "torchpar DDP: bucket index ", i, " out of range");
      TORCH_CHECK(slots_[i].bucket == SIZE_MAX, "torchpar DDP: parameter '", names_[i], "' is in two buckets");
      b.sparse = !options_.sparse.empty() && options_.sparse[i];
      TORCH_CHECK(!b.sparse || indices.size() == 1, "torchpar DDP: parameter '", names_[i],
                  "' gets sparse gradients and needs a bucket of its own");
      TORCH_CHECK(params_[i].scalar_type() == first.scalar_type() && params_[i].device() == first.device(),
                  "torchpar DDP: bucket mixes dtypes or devices ('", names_[i], "' vs '",
                  names_[indices.front()], "')");
      slots_[i] = Slot{buckets_.size(), b.params.size()};
      b.params.push_back(i);
      b.offsets.push_back(shards.empty() ? numel : shards[bi].offsets[b.offsets.size()]);
      numel += params_[i].numel();
    }
    b.numel = numel;
    if (!shards.empty()) {
      b.shard_numel = shards[bi].shard_numel;
      b.owners = shards[bi].owners;
      b.numel = b.shard_numel * world;
      b.shard = at::zeros({b.shard_numel}, first.options().dtype(dtype));
    }
    b.options = first.options().dtype(dtype);
    b.grads_are_views = options_.gradient_as_bucket_view && dtype == first.scalar_type() && shards.empty() && !b.sparse;
    // A bucket whose gradients are reduced where they lie needs its flat tensor only for a
    // gradient that cannot be (allocate() on demand): no second copy of every gradient.
    // A sharded bucket's flat tensor lives from its first gradient to its reduce-scatter.
    if (!reduces_in_place(b) && shards.empty()) {
      allocate(b);  // (a sparse bucket has none)
    }
    if (b.grads_are_views) {
      for (size_t k = 0; k < b.params.size(); ++k) {
        // Gradients kept from before (or from the previous buckets, on a rebuild) move in.
        const at::Tensor& p = params_[b.params[k]];
        if (p.grad().defined()) {
          b.views[k].copy_(p.grad());
          p.mutable_grad() = b.views[k];
        }
      }
    }
    buckets_.push_back(std::move(b));
  }
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(slots_[i].bucket != SIZE_MAX, "torchpar DDP: parameter '", names_[i], "' is in no bucket");
  }
  for (auto& b : buckets_) {
    b.pending = b.params.size();
  }
}

Reducer::~Reducer() {
  // A graph built before this reducer died may still run backward; the hook must not
  // call into freed memory.
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    accumulators_[i]->del_post_hook(hook_keys_[i]);
    if (!pre_hooks_.empty()) {  // Node has no del_pre_hook: erased by address
      auto& hooks = accumulators_[i]->pre_hooks();
      hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                                 [&](const auto& h) { return h.get() == pre_hooks_[i]; }),
                  hooks.end());
    }
  }
}

void Reducer::before_accumulation(int64_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  const bool create_graph = at::GradMode::is_enabled();  // (read before the guard below)
  at::NoGradGuard no_grad;
  at::Tensor& grad = params_[index].mutable_grad();
  replaced_by_autograd_[index] = create_graph && grad.defined() && is_recorded(kept_[index], grad) &&
                                 static_cast<int64_t>(grad._version()) == kept_version_[index];
  if (!grad.defined() || !is_recorded(handed_[index], grad)) {
    return;
  }
  handed_[index].reset();
  at::Tensor shard = shard_slice(index);
  if (grad.is_alias_of(shard)) {
    grad = grad.clone();  // autograd adds into the copy; the shard keeps A
  } else {
    shard.copy_(grad.reshape(-1));  // a cast copy: A as .grad holds it now
  }
  kept_[index].emplace(grad.getIntrusivePtr());
  kept_version_[index] = static_cast<int64_t>(grad._version());
  replaced_by_autograd_[index] = create_graph;
}

void Reducer::check_kept_locked(int64_t index) {
  if (!kept_[index]) {
    return;
  }
  const at::Tensor& grad = params_[index].grad();
  if (replaced_by_autograd_[index]) {
    // create_graph=True: autograd replaced the kept .grad by its sum with the new gradient.
    replaced_by_autograd_[index] = false;
    if (grad.defined() && !is_recorded(kept_[index], grad)) {
      kept_[index].emplace(grad.getIntrusivePtr());
      kept_version_[index] = static_cast<int64_t>(grad._version());
      return;
    }
  }
  if (grad.defined() && is_recorded(kept_[index], grad) &&
      static_cast<int64_t>(grad._version()) == kept_version_[index] + 1) {
    kept_version_[index] += 1;
  } else {
    kept_[index].reset();
  }
}

bool Reducer::is_recorded(const WeakTensorRef& ref, const at::Tensor& grad) {
  return ref && !ref->expired() && ref->_unsafe_get_target() == grad.unsafeGetTensorImpl();
}

at::Tensor Reducer::shard_slice(int64_t index) {
  const Bucket& b = buckets_[slots_[index].bucket];
  const size_t k = slots_[index].offset;
  return b.shard.narrow(0, b.offsets[k] - group_->getRank() * b.shard_numel, params_[index].numel());
}

void Reducer::reset_step() {
  expect_backward_ = false;
  backward_started_ = false;
  finalize_queued_ = false;
  hooks_seen_.assign(params_.size(), 0);
  std::fill(ready_.begin(), ready_.end(), false);
  std::fill(reachable_.begin(), reachable_.end(), true);
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.reduction = Reduction{};
    b.inputs.assign(b.params.size(), at::Tensor());  // no gradient kept alive past the step
    b.in_place.assign(b.params.size(), false);
  }
  next_launch_ = 0;
}

void Reducer::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mutex_);
  // A backward that ended inside a reentrant one with gradients still missing, and got no
  // more (see finalize), is noticed here.
  if (expect_backward_ && backward_started_) {
    const std::string missing = params_without_gradient();
    // Reductions already launched still write into .grad (or the buckets): let them finish.
    wait_launched();
    reset_step();
    TORCH_CHECK(false, "torchpar DDP: the previous step's backward ended (or raised) before these "
                "parameters got a gradient, so that step's gradients were not all averaged: ",
                missing, ". ",
                options_.static_graph ? "With static_graph=True every step must give the gradients "
                                        "of the first."
                                      : "Pass find_unused_parameters=True if a step may leave "
                                        "parameters unused.");
  }
  reset_step();
  trace_.clear();
  ready_order_.clear();
  expect_backward_ = true;
  round_ = fresh_round();
  if (!options_.find_unused_parameters || options_.static_graph) {
    return;
  }
  // Every grad accumulator reachable from the outputs will fire; the others will not.
  std::unordered_set<const autograd::Node*> seen;
  std::vector<autograd::Node*> stack;
  for (const auto& t : outputs) {
    if (!t.defined() || !t.requires_grad()) {
      continue;
    }
    auto fn = autograd::impl::gradient_edge(t).function;
    if (fn && seen.insert(fn.get()).second) {
      stack.push_back(fn.get());
    }
  }
  while (!stack.empty()) {
    autograd::Node* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) {
      if (edge.function && seen.insert(edge.function.get()).second) {
        stack.push_back(edge.function.get());
      }
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    reachable_[i] = seen.count(accumulators_[i].get()) > 0;
  }
}

bool Reducer::reduce_if_unreached() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    at::NoGradGuard no_grad;
    if (!expect_backward_ || backward_started_) {
      return false;
    }
    backward_started_ = true;
    try {
      for (size_t i = 0; i < params_.size(); ++i) {
        mark_ready(static_cast<int64_t>(i), used_since_sync_[i] != 0);
      }
    } catch (...) {
      wait_launched();
      reset_step();
      throw;
    }
  }
  finalize();  // not inside a backward: it waits, writes back and disarms now
  return true;
}

void Reducer::cancel_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  round_.open = false;
  // The failed step's uses are not reduced; a peer that completed its backward cleared its own.
  // (Also when a finalize that raised has disarmed already: it left them set.)
  std::fill(used_since_sync_.begin(), used_since_sync_.end(), 0);
  if (!expect_backward_) {
    return;
  }
  wait_launched();
  reset_step();
}

int64_t Reducer::completed_backwards() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_;
}

void Reducer::abandon_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  at::NoGradGuard no_grad;
  // Not armed: this rank failed before its synchronised backward started and owes all of it.
  const Round owed = round_.open ? round_ : fresh_round();
  round_.open = false;
  // The failed step's uses are not reduced; the peers' finalize cleared theirs (review: a
  // parameter used only in the failed step later counted as used, and got zeros, not None).
  std::fill(used_since_sync_.begin(), used_since_sync_.end(), 0);
  wait_launched();  // (a finalize that raised has let go of its reductions: they run on)
  try {
    for (size_t i = owed.launched; i < buckets_.size(); ++i) {
      const Bucket& b = buckets_[i];
      if (reduces_in_place(b)) {  // the same collective the peers issue for this bucket
        std::vector<at::Tensor> zeros;
        for (int64_t k : b.params) {
          zeros.push_back(at::zeros_like(params_[k], at::MemoryFormat::Contiguous));
        }
        group_->allreduce_coalesced(zeros)->wait();
        continue;
      }
      reduce_zeros(i);
    }
    if (step_reduces_used_flags() && !owed.flags_issued) {
      reduce_used_flags(/*zeros=*/true);
    }
    if (owed.rebuild_owed) {
      rebuild_in_observed_order();  // the peers rebuild in this step's finalize
    }
  } catch (...) {
    reset_step();
    throw;
  }
  reset_step();
}

at::Tensor Reducer::reduce_zeros(size_t index) {
  const Bucket& b = buckets_[index];
  at::Tensor zeros = b.sparse ? empty_sparse_gradient(b) : at::zeros({b.numel}, b.options);
  Reduction r = start_reduction(index, zeros);
  return finish_reduction(r, zeros);
}

void Reducer::wait_launched() {
  for (auto& b : buckets_) {
    try {
      if (b.reduction.work) b.reduction.work->wait();
      if (b.reduction.hook_result) b.reduction.hook_result->wait();
    } catch (...) {  // NOLINT(bugprone-empty-catch): the caller reports the error that matters
    }
  }
}

void Reducer::on_gradient(int64_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  at::NoGradGuard no_grad;
  used_since_sync_[index] = 1;
  check_kept_locked(index);
  if (!expect_backward_) {
    return;  // no_sync(): the gradient just accumulates in .grad
  }
  if (!finalize_queued_) {
    queue_finalize_locked();
  }
  if (!backward_started_) {
    backward_started_ = true;
    // Parameters that will get no gradient count as ready now: those the outputs do not reach
    // (find_unused_parameters), or that got none in the first step (static_graph). Deferring
    // this to the first hook (not prepare_for_backward) keeps all collectives inside backward,
    // so they cannot interleave with collectives the user issues between forward and backward.
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!reachable_[i] || (hooks_recorded_ && hooks_expected_[i] == 0)) {
        mark_ready(static_cast<int64_t>(i), used_since_sync_[i] != 0);
      }
    }
  }
  if (!rebuilt_ && hooks_seen_[index] == 0) {
    ready_order_.push_back(index);
  }
  const int32_t seen = ++hooks_seen_[index];
  if (!options_.static_graph) {
    mark_ready(index, true);
  } else if (hooks_recorded_) {
    // The record says how many gradients this parameter gets (reentrant checkpoints can
    // deliver several); .grad holds their sum once the last has arrived.
    TORCH_CHECK(seen <= hooks_expected_[index], "torchpar DDP: static_graph=True, but parameter '",
                names_[index], "' got ", seen, " gradients in this step and ", hooks_expected_[index],
                " in the first: the autograd graph changed between steps.");
    if (seen == hooks_expected_[index]) {
      mark_ready(index, true);
    }
  }
  // else: the first static_graph step, recorded here and reduced all at once in finalize.
}

void Reducer::mark_all_ready_for_recording() {
  for (size_t i = 0; i < params_.size(); ++i) {
    mark_ready(static_cast<int64_t>(i), used_since_sync_[i] != 0);  // this step's or no_sync's
  }
}

bool Reducer::records_static_graph() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return options_.static_graph && !hooks_recorded_;
}

bool Reducer::step_reduces_used_flags() const {
  return options_.find_unused_parameters || (options_.static_graph && !flags_recorded_);
}

void Reducer::queue_finalize() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (expect_backward_ && !finalize_queued_) {
    queue_finalize_locked();
  }
}

void Reducer::queue_finalize_locked() {
  // Runs on this graph task once it has finished: wait and write back.
  finalize_queued_ = true;
  autograd::Engine::get_default_engine().queue_callback([this] { finalize(); });
}

std::string Reducer::params_without_gradient() const {
  std::ostringstream missing;
  int shown = 0;
  for (size_t i = 0; i < params_.size() && shown < 5; ++i) {
    if (!ready_[i]) {
      missing << (shown++ ? ", " : "") << "'" << names_[i] << "'";
    }
  }
  return missing.str();
}

void Reducer::mark_ready(int64_t index, bool has_gradient) {
  TORCH_CHECK(!ready_[index], "torchpar DDP: parameter '", names_[index],
              "' got a gradient twice in one step. Reentrant backward, a second backward "
              "through the same forward, or a parameter used outside the module's forward "
              "(with find_unused_parameters=True) can cause this.");
  ready_[index] = true;
  trace_.push_back({TraceEvent::kReady, index});
  const Slot& slot = slots_[index];
  Bucket& b = buckets_[slot.bucket];
  if (b.sparse) {
    mark_sparse_ready(b, index);
    return;
  }
  const at::Tensor& param = params_[index];
  const at::Tensor& grad = param.grad();
  // Averaging = dividing by the group size before the sum (an average of low-precision
  // values overflows less than their sum): in place where the gradient is reduced where it
  // lies, else fused with the copy into the bucket where the dtypes allow, to read and write
  // the gradient once.
  // With a comm hook the hook averages, as with torch's DDP (its allreduce_hook divides).
  const double scale = average_factor();
  const bool in_place = reduces_in_place(b);
  if (in_place && has_gradient && grad.defined() && grad.is_contiguous()) {
    grad.mul_(scale);
    b.inputs[slot.offset] = grad;
    b.in_place[slot.offset] = true;
    --b.pending;
    launch_ready_buckets();
    return;
  }
  allocate(b);
  at::Tensor view = b.views[slot.offset];  // a handle: mul_out takes a mutable out
  // A parameter this backward did not reach (find_unused_parameters, static_graph) keeps what
  // .grad holds, as with torch's DDP: an earlier synchronised backward's average, the same on
  // every rank, so averaging it again gives it back and a rank that did reach it adds its share
  // (the sum of several backwards without zero_grad). Under ZeRO-2 only the owner holds it: counted
  // once, as where a gradient was added into it (before_accumulation).
  const bool handed = b.shard_numel && !has_gradient && grad.defined() && is_recorded(handed_[index], grad);
  const bool kept = b.shard_numel && has_gradient && grad.defined() && is_recorded(kept_[index], grad) &&
                    static_cast<int64_t>(grad._version()) == kept_version_[index];
  kept_[index].reset();
  if (!grad.defined() || (b.shard_numel && !has_gradient && !handed)) {
    view.zero_();
  } else if (handed) {
    view.copy_(grad);
  } else if (kept) {  // (A + new gradients) / W + (W - 1) A / W
    view.copy_(grad);
    view.mul_(scale);
    view.add_(shard_slice(index).view(view.sizes()), 1.0 - scale);
  } else if (b.grads_are_views) {
    if (!grad.is_alias_of(view)) {
      // zero_grad(set_to_none=True) or the first step: autograd made a fresh tensor.
      at::mul_out(view, grad, at::scalar_tensor(scale, view.options().device(at::kCPU)));
      param.mutable_grad() = view;
    } else {
      view.mul_(scale);
    }
  } else if (grad.scalar_type() == view.scalar_type()) {
    at::mul_out(view, grad, at::scalar_tensor(scale, view.options().device(at::kCPU)));
  } else {
    view.copy_(grad);  // widen first (grad_reduce_dtype), then divide in the wider dtype
    view.mul_(scale);
  }
  if (in_place) {
    b.inputs[slot.offset] = view;  // zeros, or a strided gradient copied in
  }
  peak_grad_bytes_ = std::max(peak_grad_bytes_, bucket_bytes_locked() + (grad.defined() ? static_cast<int64_t>(grad.nbytes()) : 0));
  if (b.shard_numel && has_gradient && grad.defined()) {
    param.mutable_grad().reset();  // in the bucket now; only the owner gets it back, reduced
  }
  --b.pending;
  launch_ready_buckets();
}

at::Tensor Reducer::empty_sparse_gradient(const Bucket& b) const {
  const at::Tensor& p = params_[b.params.front()];
  std::vector<int64_t> values_shape{0};  // no rows; sparse_dim 1, as nn.Embedding's gradients
  values_shape.insert(values_shape.end(), p.sizes().begin() + 1, p.sizes().end());
  return at::sparse_coo_tensor(at::empty({1, 0}, p.options().dtype(at::kLong)), at::empty(values_shape, b.options),
                               p.sizes());
}

void Reducer::mark_sparse_ready(Bucket& b, int64_t index) {
  // As for a dense bucket, a .grad this backward did not reach takes part as it is (a previous
  // average, the same everywhere: given back). What is reduced is always a new tensor: the
  // reduction replaces its rows, and .grad keeps its own until write_back_sparse.
  const at::Tensor& grad = params_[index].grad();
  const double scale = average_factor();
  at::Tensor input;
  if (!grad.defined()) {
    input = empty_sparse_gradient(b);
  } else {
    // A weight also used densely (a tied output layer) gets a dense gradient: its nonzero rows.
    input = (grad.is_sparse() ? grad : grad.to_sparse(1)).to(b.options.dtype()).mul(scale);
  }
  b.inputs[0] = input;
  --b.pending;
  launch_ready_buckets();
}

void Reducer::write_back_sparse(Bucket& b, const at::Tensor& reduced, const std::vector<int32_t>& used_anywhere) {
  const int64_t i = b.params.front();
  if (!used_anywhere[i]) {
    return;  // unused everywhere: .grad stays as it is, as for a dense bucket
  }
  const at::Tensor& param = params_[i];
  TORCH_CHECK(reduced.is_sparse() && reduced.sizes() == param.sizes(), "torchpar DDP: the reduction of parameter '",
              names_[i], "' (sparse gradients) returned a ", reduced.is_sparse() ? "sparse" : "dense", " tensor of shape ",
              reduced.sizes(), "; expected a sparse tensor of shape ", param.sizes());
  at::Tensor average = reduced.coalesce().to(param.scalar_type());
  const at::Tensor& grad = param.grad();
  if (grad.defined() && !grad.is_sparse()) {
    grad.copy_(average.to_dense());
  } else {
    param.mutable_grad() = average;
  }
}

void Reducer::launch_ready_buckets() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
    Bucket& b = buckets_[next_launch_];
    if (b.shard_numel && next_launch_ > 0) {
      release_flat(buckets_[next_launch_ - 1]);  // one reduce-scatter in flight
    }
    if (reduces_in_place(b)) {
      b.reduction = Reduction{group_->allreduce_coalesced(b.inputs), {}};
    } else if (b.sparse) {
      b.reduction = start_reduction(next_launch_, b.inputs[0]);
    } else {
      b.reduction = start_reduction(next_launch_, b.flat);
    }
    trace_.push_back({TraceEvent::kLaunch, static_cast<int64_t>(next_launch_)});
    ++next_launch_;
    if (round_.open) round_.launched = next_launch_;
  }
}

double Reducer::average_factor() const {
  return comm_hook_ ? 1.0 : 1.0 / group_->getSize();
}

bool Reducer::reduces_in_place(const Bucket& b) const {
  return options_.reduce_grads_in_place && !comm_hook_ && !b.grads_are_views && !b.shard_numel && !b.sparse &&
         b.options.dtype() == params_[b.params.front()].dtype();
}

Reducer::Reduction Reducer::start_reduction(size_t index, const at::Tensor& buffer) {
  Reduction r;
  const Bucket& b = buckets_[index];
  if (b.shard_numel) {
    // This rank's segment of the sum (a joined rank's too: its zeros, the others' gradients).
    at::Tensor out = b.shard;
    at::Tensor in = buffer;
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"  // reduce_scatter_single is torch >= 2.13
    r.work = group_->_reduce_scatter_base(out, in);
#pragma GCC diagnostic pop
  } else if (comm_hook_) {
    auto bucket = grad_bucket(index, buffer);
    r.hook_result = comm_hook_->runHook(bucket);
  } else {
    std::vector<at::Tensor> tensors{buffer};
    r.work = group_->allreduce(tensors);
  }
  return r;
}

at::Tensor Reducer::finish_reduction(Reduction& r, const at::Tensor& buffer) {
  if (!r.hook_result) {
    r.work->wait();
    if (buffer.is_sparse()) {  // a backend may return the sum rather than write it into the input
      const std::vector<at::Tensor> out = r.work->result();
      if (out.size() == 1 && out[0].defined()) {
        return out[0];
      }
    }
    return buffer;
  }
  r.hook_result->wait();
  at::Tensor reduced = comm_hook_->parseHookResult(r.hook_result->value());  // value() rethrows the hook's error
  TORCH_CHECK(reduced.numel() == buffer.numel(),
              "torchpar DDP: the comm hook's future holds a tensor of ", reduced.numel(),
              " elements; the bucket has ", buffer.numel());
  return reduced;
}

c10d::GradBucket Reducer::grad_bucket(size_t index, const at::Tensor& buffer) const {
  const Bucket& b = buckets_[index];
  std::vector<size_t> offsets, lengths;
  std::vector<c10::IntArrayRef> sizes;
  std::vector<at::Tensor> params;
  for (size_t k = 0; k < b.params.size(); ++k) {
    // A sparse bucket's buffer is its one parameter's sparse gradient, as in torch's GradBucket.
    offsets.push_back(b.sparse ? 0 : b.views[k].storage_offset() - b.flat.storage_offset());
    lengths.push_back(params_[b.params[k]].numel());
    sizes.push_back(params_[b.params[k]].sizes());
    params.push_back(params_[b.params[k]]);
  }
  return c10d::GradBucket(index, buckets_.size(), buffer, std::move(offsets), std::move(lengths),
                          std::move(sizes), std::move(params), std::nullopt);
}

void Reducer::join_shadow_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  at::NoGradGuard no_grad;
  synced_once_ = true;
  reset_step();
  std::vector<at::Tensor> reduced;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    reduced.push_back(reduce_zeros(i));
  }
  std::vector<int32_t> used_anywhere(params_.size(), 1);
  if (step_reduces_used_flags()) {
    used_anywhere = reduce_used_flags(/*zeros=*/true);
    if (options_.static_graph && !flags_recorded_) {
      // The training ranks' first step: keep their flags, as they do. This rank's own gradient
      // counts are recorded in its first step of training, if it has one (a later epoch).
      used_in_record_ = used_anywhere;
      flags_recorded_ = true;
    }
  } else if (flags_recorded_) {
    used_anywhere = used_in_record_;
  }
  // .grad as after a synchronised backward, from what the others reduced.
  for (size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& b = buckets_[i];
    if (b.shard_numel) {
      write_back_shard(b, used_anywhere);
      continue;
    }
    if (b.sparse) {
      write_back_sparse(b, reduced[i], used_anywhere);
      continue;
    }
    if (!b.flat.defined()) {  // reduced where the gradients lie in training steps: no flat tensor
      for (size_t k = 0; k < b.params.size(); ++k) {
        const at::Tensor& param = params_[b.params[k]];
        if (used_anywhere[b.params[k]]) {
          param.mutable_grad() = reduced[i].narrow(0, b.offsets[k], param.numel()).view(param.sizes());
        }
      }
      continue;
    }
    if (!reduced[i].is_same(b.flat)) {
      b.flat.copy_(reduced[i].reshape(b.flat.sizes()));
    }
    write_back(b, used_anywhere);
  }
  if (!rebuilt_) {
    rebuild_in_observed_order();  // takes rank 0's order, as the training ranks do
  }
}

void Reducer::register_comm_hook(std::unique_ptr<c10d::CommHookInterface> hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!comm_hook_, "torchpar DDP: register_comm_hook can only be called once");
  TORCH_CHECK(!options_.shard_gradients,
              "torchpar DDP: shard_gradients=True reduce-scatters each bucket; a comm hook "
              "(which returns the whole reduced bucket) does not apply");
  TORCH_CHECK(!synced_once_,
              "torchpar DDP: register_comm_hook must be called before the first backward");
  comm_hook_ = std::move(hook);
  for (auto& b : buckets_) {
    allocate(b);  // the hook gets each bucket's flat tensor
  }
}

void Reducer::finalize() {
  std::lock_guard<std::mutex> lock(mutex_);
  at::NoGradGuard no_grad;
  if (!expect_backward_) {
    return;
  }
  // The graph task that ran this callback may be a reentrant backward nested in the step's
  // (torch.utils.checkpoint(use_reentrant=True) runs one per checkpoint, and the first
  // gradients can arrive in it). Then a node of the outer backward is still being evaluated,
  // and the outer backward's later gradients queue the next finalize. A step that records
  // its gradient counts cannot tell whether more will come: it waits for the outermost.
  const bool recording = options_.static_graph && !hooks_recorded_;
  if (autograd::get_current_node() && (recording || next_launch_ < buckets_.size())) {
    finalize_queued_ = false;
    return;
  }
  trace_.push_back({TraceEvent::kFinalize, -1});
  synced_once_ = true;
  try {
    if (recording) {
      mark_all_ready_for_recording();
    }
    if (next_launch_ < buckets_.size()) {
      const char* hint = options_.static_graph
                             ? "They did in the first step, and static_graph=True promises the "
                               "same autograd graph every step."
                         : options_.find_unused_parameters
                             ? "They are reachable from the forward's outputs, yet autograd did not "
                               "reach them: was backward started from another tensor?"
                             : "Pass find_unused_parameters=True if a step may leave parameters "
                               "unused.";
      TORCH_CHECK(false, "torchpar DDP: backward finished but these parameters got no gradient: ",
                  params_without_gradient(), ". ", hint);
    }
    // Globally unused parameters keep their .grad as it is (None stays None), as in
    // torch's DDP; telling them apart needs every rank's used flags.
    // With static_graph, the first step's flags hold for every later step.
    const std::vector<int32_t> used_anywhere = step_reduces_used_flags() ? reduce_used_flags()
                                               : flags_recorded_         ? used_in_record_
                                                                 : std::vector<int32_t>(params_.size(), 1);
    // Bucket by bucket, so that copying out an early bucket overlaps the all-reduce of
    // the later ones.
    for (auto& b : buckets_) {
      if (b.shard_numel) {
        release_flat(b);
        write_back_shard(b, used_anywhere);
        continue;
      }
      if (b.sparse) {
        write_back_sparse(b, finish_reduction(b.reduction, b.inputs[0]), used_anywhere);
        continue;
      }
      const at::Tensor reduced = finish_reduction(b.reduction, b.flat);
      if (!reduced.is_same(b.flat)) {
        b.flat.copy_(reduced.reshape(b.flat.sizes()));
      }
      write_back(b, used_anywhere);
    }
    if (!rebuilt_) {
      rebuild_in_observed_order();
    }
    if (recording) {
      hooks_expected_ = hooks_seen_;
      hooks_recorded_ = true;
    }
    if (options_.static_graph && !flags_recorded_) {
      used_in_record_ = used_anywhere;
      flags_recorded_ = true;
    }
  } catch (...) {
    reset_step();
    throw;
  }
  std::fill(used_since_sync_.begin(), used_since_sync_.end(), 0);
  reset_step();
  round_.open = false;
  ++completed_;
}

void Reducer::rebuild_in_observed_order() {
  // Once only, as torch's DDP does (Li et al., VLDB 2020, section 4.2.2): later steps
  // are assumed to produce gradients in the order of the first one.
  rebuilt_ = true;
  std::vector<int64_t> order = ready_order_;
  ready_order_.clear();
  std::vector<bool> listed(params_.size(), false);
  for (int64_t i : order) {
    listed[i] = true;
  }
  for (int64_t i = static_cast<int64_t>(params_.size()) - 1; i >= 0; --i) {
    if (!listed[i]) {
      order.push_back(i);  // unused in that step: last, in reverse registration order
    }
  }
  // Ranks may have seen different orders (autograd threads race); all take rank 0's,
  // since every rank must fill and launch the same buckets.
  at::Tensor shared = at::tensor(order, at::kLong).to(params_.front().device());
  std::vector<at::Tensor> tensors{shared};
  auto work = group_->broadcast(tensors);
  round_.rebuild_owed = false;
  work->wait();
  shared = shared.cpu();
  order.assign(shared.data_ptr<int64_t>(), shared.data_ptr<int64_t>() + shared.numel());
  auto buckets = assign_buckets(params_, options_.cap_bytes, options_.first_cap_bytes,
                                options_.reduce_dtype, order, options_.sparse);
  if (buckets != bucket_indices()) {
    build_buckets(buckets);
  }
}

std::vector<int32_t> Reducer::reduce_used_flags(bool zeros) {
  // One more small all-reduce, issued after every bucket (same order on all ranks).
  at::Tensor used = zeros ? at::zeros({static_cast<int64_t>(params_.size())}, params_.front().options().dtype(at::kInt))
                          : at::tensor(used_since_sync_, at::kInt).to(params_.front().device());
  std::vector<at::Tensor> tensors{used};
  auto work = group_->allreduce(tensors);
  round_.flags_issued = true;
  work->wait();
  at::Tensor host = used.cpu();
  return std::vector<int32_t>(host.data_ptr<int32_t>(), host.data_ptr<int32_t>() + host.numel());
}

void Reducer::write_back(Bucket& b, const std::vector<int32_t>& used_anywhere) {
  for (size_t k = 0; k < b.params.size(); ++k) {
    const int64_t i = b.params[k];
    if (!used_anywhere[i] || b.in_place[k]) {
      continue;  // unused everywhere: .grad stays as it is; in place: reduced where it lies
    }
    const at::Tensor& param = params_[i];
    const at::Tensor& grad = param.grad();
    if (b.grads_are_views) {
      if (!grad.defined() || !grad.is_alias_of(b.views[k])) {
        param.mutable_grad() = b.views[k];
      }
    } else if (grad.defined()) {
      grad.copy_(b.views[k]);
    } else {
      param.mutable_grad() = at::empty_like(param).copy_(b.views[k]);
    }
  }
}

void Reducer::write_back_shard(Bucket& b, const std::vector<int32_t>& used_anywhere) {
  const int64_t rank = group_->getRank();
  for (size_t k = 0; k < b.params.size(); ++k) {
    const int64_t i = b.params[k];
    const at::Tensor& param = params_[i];
    if (!used_anywhere[i]) {
      continue;  // unused everywhere: .grad stays as it is, as without sharding
    }
    if (b.owners[k] != rank) {
      param.mutable_grad().reset();
      continue;
    }
    at::Tensor g = b.shard.narrow(0, b.offsets[k] - rank * b.shard_numel, param.numel()).view(param.sizes());
    param.mutable_grad() = g.scalar_type() == param.scalar_type() ? g : g.to(param.scalar_type());
    handed_[i].emplace(param.grad().getIntrusivePtr());
  }
}

void Reducer::release_flat(Bucket& b) {
  if (b.reduction.work) {
    finish_reduction(b.reduction, b.flat);
    b.reduction = Reduction{};
  }
  // The whole bucket is needed again only in the next backward.
  b.flat = at::Tensor();
  b.views.clear();
}

std::vector<BucketShards> Reducer::shard_layout() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<BucketShards> out;
  for (const auto& b : buckets_) {
    if (b.shard_numel) {
      out.push_back(BucketShards{b.params, b.owners, b.offsets, b.shard_numel});
    }
  }
  return out;
}

std::vector<TraceEvent> Reducer::trace() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return trace_;
}

std::vector<std::vector<int64_t>> Reducer::bucket_indices() const {
  std::vector<std::vector<int64_t>> out;
  for (const auto& b : buckets_) {
    out.push_back(b.params);
  }
  return out;
}

int64_t Reducer::bucket_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return bucket_bytes_locked();
}

int64_t Reducer::peak_grad_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_grad_bytes_;
}

void Reducer::reset_peak_grad_bytes() {
  std::lock_guard<std::mutex> lock(mutex_);
  peak_grad_bytes_ = bucket_bytes_locked();
}

int64_t Reducer::bucket_bytes_locked() const {
  int64_t bytes = 0;
  for (const auto& b : buckets_) {
    bytes += b.flat.defined() ? static_cast<int64_t>(b.flat.nbytes()) : 0;
    bytes += b.shard.defined() ? static_cast<int64_t>(b.shard.nbytes()) : 0;
  }
  return bytes;
}

std::vector<at::Tensor> Reducer::bucket_tensors() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<at::Tensor> out;
  for (auto& b : buckets_) {
    allocate(b);  // zeros, if its gradients have always been reduced where they lie
    out.push_back(b.flat);
  }
  return out;
}

}  // namespace torchpar::parallel
