// The DDP reducer: averages gradients over a process group while backward still runs.
//
// Parameters are grouped into buckets (see bucket_assignment.h), each backed by one flat
// tensor. A post-hook on every parameter's gradient accumulator copies the fresh gradient
// into its bucket; when a bucket's last gradient arrives its all-reduce is launched
// asynchronously, so communication overlaps the remainder of backward. A callback queued
// on the autograd engine runs when backward is done: it waits for every bucket and writes
// the averaged gradients into `.grad`, so `optimizer.step()` needs nothing extra.
//
// Buckets are launched strictly in index order on every rank, whatever order gradients
// arrive in, because collectives must be issued in the same order on all ranks.
//
// With shard_gradients (ZeRO-2, Rajbhandari et al. 2020, arXiv:1910.02054) each bucket is
// laid out as one segment per rank (BucketShards, bucket_assignment.h) and reduce-scattered
// instead of all-reduced: a rank keeps the averaged gradients of its own parameters only,
// in one persistent shard tensor per bucket. The full flat bucket lives from its first
// gradient until its reduce-scatter is done, which is waited for (and the bucket freed) when
// the next bucket is launched: one reduce-scatter in flight, as FSDP2 does, so at most two full
// buckets (one in flight, one filling, in backward order) exist beside the shards.
//
// Only the public c10d API (ProcessGroup::allreduce, Work::wait) is used, so the reducer
// runs on any backend: torchpar, gloo, nccl.
#pragma once

#include "parallel/bucket_assignment.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>  // torch::autograd::Node, in every torch version
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torchpar::parallel {

struct ReducerOptions {
  // Keep params' .grad as views into the buckets: saves one copy in and one copy out and
  // the memory of a second gradient copy. Ignored for buckets whose dtype differs from
  // the parameters' (grad_reduce_dtype), where a view cannot exist.
  bool gradient_as_bucket_view = false;
  // Walk the autograd graph from the forward outputs to find parameters that will get no
  // gradient this step, and count them ready (with zeros) instead of waiting forever.
  bool find_unused_parameters = false;
  // Dtype the buckets hold and reduce in; nullopt: the parameters' own dtype.
  std::optional<at::ScalarType> reduce_dtype;
  // The group's all_reduce_coalesced reduces tensors where they lie (the torchpar backend):
  // then, without gradient_as_bucket_view, a comm hook or a reduce dtype, a bucket hands it the
  // gradients themselves (averaged in place) rather than copying them into its flat tensor
  // and back out, which costs two passes over every gradient.
  bool reduce_grads_in_place = false;
  // The autograd graph is the same every step (torch's static_graph=True): the first
  // synchronised step reduces every bucket at the end of backward and records how many
  // gradients each parameter gets (none, one, or several with reentrant checkpoints); later
  // steps count ready parameters by that record, with no unused-parameter search.
  bool static_graph = false;
  // Bucket caps for rebuilding the buckets in the gradient order seen in the first step
  // (registration order is only a guess at backward's order); -1: keep the first buckets.
  int64_t cap_bytes = -1;
  int64_t first_cap_bytes = -1;
  // ZeRO-2: reduce-scatter each bucket over whole-parameter shards (shard_buckets). After a
  // synchronised backward a parameter this rank owns has .grad (a view of its bucket's
  // shard, or a cast copy with a reduce dtype); every other parameter's .grad is None: a
  // gradient is dropped as soon as it is copied into its bucket. Buckets are never rebuilt
  // (the optimizer steps the shards of this layout), and there is no comm hook. Backwards
  // without zero_grad() in between accumulate as with torch's DDP (see before_accumulation).
  bool shard_gradients = false;
  // Per parameter (empty: none): it gets sparse gradients (nn.Embedding(sparse=True)). Such a
  // parameter has a bucket of its own whose sparse gradient is all-reduced as it is (the
  // backend's sparse all_reduce: every rank's rows, summed where they meet) and handed back
  // sparse, averaged; a rank without a gradient for it takes part with an empty one.
  std::vector<bool> sparse;
};

// One entry of the per-step trace, for tests that pin the order of events.
struct TraceEvent {
  enum Kind { kReady, kLaunch, kFinalize } kind;
  int64_t index;  // parameter index for kReady, bucket index for kLaunch, -1 else
};

class Reducer {
 public:
  // `params` are the parameters to reduce (those requiring grad), `names` their names for
  // error messages, `buckets` the output of assign_buckets.
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
          std::vector<std::vector<int64_t>> buckets,
          c10::intrusive_ptr<c10d::ProcessGroup> group, ReducerOptions options);
  ~Reducer();

  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Called after a forward whose backward must synchronise gradients. `outputs` are the
  // forward's output tensors, used only with find_unused_parameters. A backward that is
  // not preceded by this call (no_sync) just accumulates gradients locally.
  void prepare_for_backward(const std::vector<at::Tensor>& outputs);

  // For a caller that arms a backward it runs itself (a pipeline stage's last micro-batch,
  // torchpar/parallel/pipeline/executor.py). After that backward returned: if no gradient
  // hook fired (it reached none of the parameters, e.g. a conditional stage), reduces now
  // what accumulated since the last reduction, with the collectives a backward that reached
  // them issues (every bucket in order, then the used flags), so data-parallel peers whose
  // backward did reach them match. Returns whether it reduced; a no-op once finalize ran.
  bool reduce_if_unreached();
  // After an armed backward raised: disarms, so the next backward without
  // prepare_for_backward only accumulates again. Reductions it launched are waited for
  // (they write into the buckets or .grad; errors ignored), nothing is written back: .grad
  // is left partly averaged and must be zeroed before the next step. Armed or not, it also
  // forgets which parameters were used since the last reduction (a failed step's uses are
  // not reduced).
  void cancel_backward();
  // After this rank's step failed while its data-parallel peers may be in a synchronised
  // backward (a pipeline stage's last one, armed or not yet): issues the collectives of that
  // backward this rank has not (the buckets not launched, with zeros, in index order; the
  // used flags; the one-time bucket rebuild), so that the peers' reductions complete rather
  // than wait for the timeout, then disarms as cancel_backward does. What an armed backward
  // issued is counted until it completes, through a finalize that raised part-way too. Their
  // result is nobody's average (the peers learn the step failed from the pipeline's
  // agreement); .grad is left as the failed step left it (not under shard_gradients, whose
  // reduce-scatter writes the owner's shard; a pipeline never arms such a DDP). Call it only
  // for a backward that did not complete (see completed_backwards): it cannot tell one that
  // completed from one that never started, and would issue all of it again.
  void abandon_backward();
  // Synchronised backwards completed (finalize ran through): a caller whose armed backward
  // raised tells a failure after the reduction from one before or inside it.
  int64_t completed_backwards() const;

  // Replaces each bucket's all-reduce with `hook` (c10d's interface, so torch's own hooks
  // and Python hooks through c10d::PythonCommHook both fit): it gets the bucket's summed-
  // not-averaged gradients as a c10d::GradBucket and returns a future of the reduced flat
  // tensor, as with torch's DDP.register_comm_hook. Once, before the first synchronised
  // backward.
  void register_comm_hook(std::unique_ptr<c10d::CommHookInterface> hook);

  // Queues the end-of-backward callback on the graph task now running, unless one is queued.
  // The first static_graph step calls it from a node on the forward's outputs, so the
  // callback waits for the outermost backward even if every gradient arrives inside
  // reentrant (nested) ones. Otherwise the first gradient hook queues it.
  void queue_finalize();
  // static_graph and this rank has not recorded its gradient counts yet.
  bool records_static_graph() const;

  // For a rank whose inputs have run out while others train on (DDP's join()): issues the
  // collectives of one synchronised backward (each bucket's all-reduce, reduce-scatter or comm
  // hook, the unused-parameter flags, the one-time bucket rebuild) with zeros as this rank's
  // share, and leaves the result in .grad as a synchronised backward does (the others' average:
  // a ZeRO optimizer steps this rank's shard with it).
  void join_shadow_backward();

  // The events of the last synchronised step, in order.
  std::vector<TraceEvent> trace() const;
  // Bucket -> parameter indices, and each bucket's flat tensor (for tests and tools).
  std::vector<std::vector<int64_t>> bucket_indices() const;
  std::vector<at::Tensor> bucket_tensors();  // allocates any not made yet; undefined for a sparse bucket
  // Bytes of bucket tensors allocated so far (flat buckets and gradient shards).
  int64_t bucket_bytes() const;
  // The highest bucket_bytes() plus the bytes of the parameter gradient being copied in, seen at
  // any gradient's arrival since reset_peak_grad_bytes(): a synchronised backward's peak of
  // gradient memory (the .grad autograd made lives only until its copy into the bucket).
  int64_t peak_grad_bytes() const;
  void reset_peak_grad_bytes();
  // With shard_gradients: each bucket's whole-parameter shards, the layout the ZeRO
  // optimizer must step and all-gather by.
  std::vector<BucketShards> shard_layout() const;

 private:
  // A bucket's reduction in flight: the all-reduce, or the comm hook's future.
  struct Reduction {
    c10::intrusive_ptr<c10d::Work> work;
    c10::intrusive_ptr<c10::ivalue::Future> hook_result;
  };
  struct Bucket {
    int64_t numel = 0;
    at::TensorOptions options;        // of `flat`: the reduce dtype
    at::Tensor flat;                  // every gradient of the bucket, back to back (see allocate)
    std::vector<int64_t> params;      // parameter indices
    std::vector<int64_t> offsets;     // element offset of each in `flat`
    // shard_gradients: `flat` is world-size segments of shard_numel; owners[k] holds params[k]
    // and keeps its averaged gradient in `shard` (this rank's segment, reduce-scattered into).
    int64_t shard_numel = 0;
    std::vector<int64_t> owners;
    at::Tensor shard;
    // One parameter with sparse gradients (ReducerOptions::sparse): no flat tensor, no views;
    // inputs[0] holds what is reduced (its averaged gradient, or an empty sparse tensor).
    bool sparse = false;
    std::vector<at::Tensor> views;    // views of `flat` shaped like each parameter
    bool grads_are_views = false;     // .grad aliases `views` (gradient_as_bucket_view)
    size_t pending = 0;               // gradients still to arrive this step
    Reduction reduction;              // this step's, once launched
    // With reduce_grads_in_place: what is reduced for each parameter this step, its .grad
    // (in_place) or its view (zeros, or a gradient that could not be reduced where it lies).
    std::vector<at::Tensor> inputs;
    std::vector<bool> in_place;
  };
  struct Slot {                       // where parameter i lives
    size_t bucket;
    size_t offset;                    // index into Bucket::params / views
  };

  void build_buckets(const std::vector<std::vector<int64_t>>& buckets);
  // Creates b.flat (zeros) and its per-parameter views, once.
  void allocate(Bucket& b);
  void rebuild_in_observed_order();
  void on_gradient(int64_t index);
  // shard_gradients, before autograd adds a new gradient into parameter `index`'s .grad. torch's
  // DDP accumulates across backwards without zero_grad by averaging whatever .grad holds: after
  // a synchronised backward every rank holds the same average A, so the next synchronised one
  // gives A + the average of the new gradients. Under ZeRO-2 only the owner holds A (the others'
  // copies were dropped). So when a backward first adds into the .grad the reducer handed out,
  // the owner keeps A aside in its shard (the .grad a view of the shard becomes a copy that
  // autograd adds into; a cast copy's value is written into the shard), and the next
  // synchronised backward's reduction gets (.grad + (W - 1) A) / W from it: A counted as if every
  // rank held it. .grad itself reads A + the new gradients throughout, as with torch's DDP.
  void before_accumulation(int64_t index);
  // A weak reference to a .grad: it holds no memory, and the TensorImpl's address cannot be
  // reused by another tensor while it is held.
  using WeakTensorRef = std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>>;
  // Whether `grad` is the tensor `ref` records.
  static bool is_recorded(const WeakTensorRef& ref, const at::Tensor& grad);
  // The shard slice holding parameter `index`'s average (this rank owns it).
  at::Tensor shard_slice(int64_t index);
  // After each accumulation into parameter `index`'s .grad: A stays counted only while .grad is
  // the tensor it was kept for and nothing but autograd's accumulation changed it (a version
  // bump each; under create_graph=True, the new tensor autograd puts in its place);
  // zero_grad(set_to_none=False) or a .grad replaced by hand drop it.
  void check_kept_locked(int64_t index);
  void mark_ready(int64_t index, bool has_gradient);
  void launch_ready_buckets();
  // What each rank's gradient is multiplied by before the sum: 1 / group size (the sum is the
  // average), or 1 with a comm hook, which averages itself as with torch's DDP.
  double average_factor() const;
  bool reduces_in_place(const Bucket& b) const;
  // Reduces `buffer` as bucket `index` (the bucket's own flat tensor, or zeros for a rank
  // that has joined): starts the all-reduce or the comm hook; finish waits, rethrows a
  // failure and returns the reduced tensor.
  Reduction start_reduction(size_t index, const at::Tensor& buffer);
  at::Tensor finish_reduction(Reduction& r, const at::Tensor& buffer);
  c10d::GradBucket grad_bucket(size_t index, const at::Tensor& buffer) const;
  // shard_gradients: wait for b's reduce-scatter (its shard is final) and free its flat tensor.
  void release_flat(Bucket& b);
  int64_t bucket_bytes_locked() const;
  void finalize();
  // The first static_graph step: every parameter counts ready now, with or without a gradient.
  void mark_all_ready_for_recording();
  // The unused-parameter flags are all-reduced at the end of this step.
  bool step_reduces_used_flags() const;
  void queue_finalize_locked();
  std::string params_without_gradient() const;
  // `zeros`: this rank's share is zeros (join's shadow, a failed step's abandon_backward).
  std::vector<int32_t> reduce_used_flags(bool zeros = false);
  // Bucket `index`'s reduction with zeros as this rank's share; returns the reduced buffer.
  at::Tensor reduce_zeros(size_t index);
  // A sparse bucket's share of a rank with no gradient for its parameter: no rows.
  at::Tensor empty_sparse_gradient(const Bucket& b) const;
  // A sparse bucket's parameter is ready: its gradient, averaged (a copy), is what is reduced.
  void mark_sparse_ready(Bucket& b, int64_t index);
  // After a sparse bucket's reduction: .grad takes the average (sparse; dense where autograd
  // left this rank a dense gradient, a weight also used densely).
  void write_back_sparse(Bucket& b, const at::Tensor& reduced, const std::vector<int32_t>& used_anywhere);
  void write_back(Bucket& b, const std::vector<int32_t>& used_anywhere);
  void write_back_shard(Bucket& b, const std::vector<int32_t>& used_anywhere);
  void reset_step();
  // Waits for the reductions launched this step, ignoring their errors (mutex_ held).
  void wait_launched();

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<Bucket> buckets_;
  std::vector<Slot> slots_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  ReducerOptions options_;
  std::unique_ptr<c10d::CommHookInterface> comm_hook_;
  bool synced_once_ = false;          // a synchronised backward has run

  // Grad accumulators are held here: a parameter only keeps a weak reference to its own,
  // and a fresh one (without our hook) would be made if this one were freed.
  // What grad_accumulator() returns: c10::intrusive_ptr<Node>, or std::shared_ptr in older torch (2.11).
  using AccumulatorPtr =
      decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<AccumulatorPtr> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  std::vector<const torch::autograd::FunctionPreHook*> pre_hooks_;  // shard_gradients: before_accumulation's
  // shard_gradients, per parameter this rank owns: the .grad a synchronised backward handed out,
  // until a later backward adds into it; then the .grad that holds the average kept aside in the
  // shard (before_accumulation) and its version after the last accumulation.
  std::vector<WeakTensorRef> handed_;
  std::vector<WeakTensorRef> kept_;
  std::vector<int64_t> kept_version_;
  std::vector<bool> replaced_by_autograd_;  // a create_graph backward is adding into a kept .grad

  // Step state, guarded by mutex_ (hooks run on autograd device threads).
  mutable std::mutex mutex_;
  bool expect_backward_ = false;      // prepare_for_backward was called
  bool backward_started_ = false;     // first hook of the step ran, callback queued
  bool finalize_queued_ = false;      // a finalize callback waits on some graph task
  std::vector<bool> ready_;
  std::vector<bool> reachable_;       // find_unused: parameter reached from the outputs
  std::vector<int32_t> used_since_sync_;  // got a gradient since the last reduction
  size_t next_launch_ = 0;
  // The collectives of the armed backward now owed to the peers, from prepare_for_backward until
  // it completes (kept through a finalize that raised, unlike the step state reset_step clears).
  struct Round {
    bool open = false;
    size_t launched = 0;         // buckets issued, in index order
    bool flags_issued = false;   // the used-flags all-reduce
    bool rebuild_owed = false;   // the one-time rebuild's broadcast
  } round_;
  Round fresh_round() const { return Round{true, 0, false, !rebuilt_}; }
  int64_t completed_ = 0;
  std::vector<TraceEvent> trace_;
  std::vector<int64_t> ready_order_;  // hook order in the first synchronised step
  std::vector<int32_t> hooks_seen_;   // gradients per parameter this step
  std::vector<int32_t> hooks_expected_;  // static_graph: per parameter, from the first step
  std::vector<int32_t> used_in_record_;  // static_graph: used on some rank in the first step
  bool flags_recorded_ = false;       // static_graph: used_in_record_ is set (the group's first step)
  bool hooks_recorded_ = false;       // static_graph: hooks_expected_ is set (this rank's first step)
  bool rebuilt_ = false;
  int64_t peak_grad_bytes_ = 0;
};

}  // namespace torchpar::parallel
