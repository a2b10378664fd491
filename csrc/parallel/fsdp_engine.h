// The fully-sharded data-parallel engine (issue 19): the units of one model (fsdp_flat_param.h)
// and when each is gathered, freed and reduced.
//
// A step, with units in the order the first forward ran them (the root first):
//   forward   pre_forward(u): wait for u's all-gather (or run it), then launch the next unit's,
//             so that it travels while u computes; post_forward(u): free u's gathered storage
//             (reshard_after_forward; the root keeps its own, backward needs it at once).
//   backward  pre_backward(u), when gradients reach u's outputs: gather u again (prefetched),
//             launch the all-gather of the unit before it; post_backward(u), when the gradients
//             of u's inputs are computed (an identity node on the inputs, made in forward:
//             register_post_backward): free u's storage, pack its gradients (zeros for a
//             parameter that got none) and launch their reduce-scatter, which runs while backward
//             goes on. One reduce-scatter is in flight at a time: the previous one is waited on
//             before the next is launched, so packed gradients of at most two units are alive (as
//             torch's FSDP2 does).
//             Hybrid sharding (HSDP; a unit with a replicate group): a reduce-scatter, once
//             waited on, is all-reduced over the replicate group, also in flight while backward
//             goes on (one at a time, waited on before the next is launched), and its shard is
//             handed over after that.
//   end       a callback queued on the autograd engine: reduce the units no post_backward reached
//             (inputs that need no gradient, as the root's token ids), in backward order; wait for
//             the last reduce-scatter, hand the shards to the sharded parameters' .grad, free
//             every gathered unit.
// Why the inputs' gradient, not the parameters' (AccumulateGrad hooks, until issue 19's review):
// which parameters get a gradient depends on the data (a branch taken on some ranks only), so a
// unit reduced by its last parameter's gradient was reduced in backward on some ranks and at the
// end on others, and the ranks' collectives went out of order (a hang). Whether a unit's inputs
// get a gradient depends on the model's structure, the same on every rank. The autograd engine
// runs a device's nodes in decreasing sequence number, and the identity node is made before every
// node of the unit's forward, so it runs after all of them: every gradient of u is in .grad then.
// A forward inside backward (activation checkpointing's recomputation) keeps its unit gathered
// until that unit's post_backward; a no_grad forward while a backward is pending starts no step;
// a second backward over a retained graph re-arms each unit it reaches (pre_backward), so its
// gradients are reduced and added too.
//
// Units that run on some ranks only (a data-dependent branch around a whole unit; issue 19): every
// rank must still issue the same collectives in the same order, or they pair up wrongly (a hang,
// a size mismatch, or, between units of equal size, silently wrong numbers).
//   forward   all-gathers follow one stream, the same on every rank: the units in index order in
//             the first forward, then the forward order agreed at its end (one all-gather of each
//             rank's order, merged keeping every rank's order, ties to the longest). pre_forward(u)
//             launches every unit of the stream up to u not launched yet (a unit this rank skips
//             is gathered all the same, and freed at u, or at the end of the first forward), the
//             root's post_forward the rest.
//   backward  a unit this rank's forward did not run takes its place in the backward of the
//             others as if it had run, when the unit before it in backward order is done:
//             gathered (if the others gather it), the next unit prefetched, freed, and zeros
//             reduce-scattered in its place (kSkippedBackward). Prefetch in backward follows the
//             agreed order, whatever this rank ran.
//   checked   each reduce-scatter carries every rank's unit id and whether it had gradients
//             (FlatParam::start_reduce_scatter); ranks whose reduce-scatters paired different
//             units raise, naming both; a unit no rank had gradients for leaves .grad untouched
//             (as one process would). Forward all-gathers carry no id (it would cost a copy of
//             every gathered unit): one gathered out of the stream (a unit no rank ran in the
//             first forward, a unit's forward run twice) on some ranks only is caught by the
//             reduce-scatters that follow, before any gradient is handed over.
// Otherwise every collective is issued in this order on every rank (the program is the same).
//
// Kept gathered (FlatParam::reshard_after_backward false, torch FSDP2's set_reshard_after_backward):
// a backward that does not sync the unit's gradients (gradient accumulation; a pipeline stage's
// micro-batches before its last) leaves the unit gathered, and the next step's forward and
// backward find it so and skip its all-gathers: one gather a step instead of one or two per
// micro-batch, for the memory of the gathered unit in between. A unit a forward left gathered
// (reshard_after_forward false, or the root) is kept the same way. At the start of each step
// (the root's forward), where some unit asks for this, the ranks agree which units they keep:
// each offers the units it has gathered whose shard was not written since their gather began
// (FlatParam::gathered_and_current: the shard's version counter, bumped by a checkpoint load and
// by loop or foreach optimizers, and the count of optimizer steps over the unit's parameters,
// which fused optimizers need: they do not bump the counter), unless its last backward raised,
// and one all-reduce (MIN) keeps those every rank offered; the others are freed, so the forward
// all-gathers pair and never compute with stale parameters. The same all-reduce decides whether
// a no_grad forward begins a step (pre_forward), so that ranks whose "backward pending" differ
// (one raised before reaching the model) still agree. A syncing backward frees the unit whatever
// the flag says (unlike torch's): the optimizer step follows it. A unit FSDPModule.unshard()
// gathered ahead of the step (torch FSDP2's `model.unshard()` before forward, to overlap the first
// all-gather with loading the batch) is kept the same way, offered where its gather (in flight or
// done) is of the current shard: every rank that calls unshard() alike keeps it.
//
// Explicit prefetching (torch FSDP2's set_modules_to_forward_prefetch / _backward_prefetch): a
// unit may list the units its pre_forward (pre_backward) prefetches instead of the next one, for
// deeper overlap at the memory of more gathered units. The forward all-gathers still follow the
// stream, so a listed unit is reached by advancing the stream past it: the units between are
// launched too. The lists must be the same on every rank, as torch requires: other collectives on
// the group during forward (an unshard() among them) would pair with other all-gathers, and in
// backward the all-gathers interleave with the reduce-scatters. In backward the units from the
// next one to the furthest listed one are launched, in backward order. A listed unit already
// passed (before u in forward, after u in backward) is not gathered again.

#pragma once

#include "parallel/fsdp_flat_param.h"

#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace torchpar::parallel {

// One entry of the per-step trace, for tests that pin the order of events.
struct FsdpEvent {
  enum Kind {
    kPreForward, kPostForward, kGatherLaunch, kGatherWait, kReshard,
    kPreBackward, kPostBackward, kReduceScatterLaunch, kReduceScatterWait, kFinalize,
    kSkippedBackward,  // the collectives of a unit this rank's forward did not run (see below)
    kAllReduceLaunch, kAllReduceWait,  // hybrid sharding: a reduced shard across the replicas
    kReshardToPostForward  // freed after forward, its post-forward slice kept (reshard_after_forward=N)
  } kind;
  int64_t unit;  // -1 for kFinalize
};

// Bytes of tensors the engine owns, by kind, now and at the step's peak (sampled at every event).
struct FsdpMemory {
  int64_t shards = 0;          // master shards (the parameters the optimizer steps)
  int64_t gathered = 0;        // gathered parameters (and cast shards in flight)
  int64_t unsharded_grads = 0; // gradients autograd left on the gathered parameters
  int64_t reduce_buffers = 0;  // packed gradients and reduce-scatter outputs in flight
  int64_t accumulators = 0;    // no_sync's local gradient sums
  int64_t sharded_grads = 0;   // .grad of the sharded parameters
  int64_t total() const {
    return shards + gathered + unsharded_grads + reduce_buffers + accumulators + sharded_grads;
  }
};

class FsdpEngine : public std::enable_shared_from_this<FsdpEngine> {
 public:
  // `units` in the order fully_shard made them (bound already); `root` indexes the unit whose
  // forward holds the others'.
  FsdpEngine(std::vector<std::shared_ptr<FlatParam>> units, int64_t root);

  FsdpEngine(const FsdpEngine&) = delete;
  FsdpEngine& operator=(const FsdpEngine&) = delete;

  // Called by the module hooks (torchpar/parallel/fsdp.py).
  void pre_forward(int64_t unit, bool grad_enabled);
  // In a forward with grad, before the caller puts u's inputs that require grad through an
  // identity node whose backward calls post_backward(u). Returns false where it must not: u has
  // no trained parameter, or this is the recomputation (non-reentrant checkpointing) of a forward
  // whose node is already in the graph. A forward run twice in a step has two nodes; u is reduced
  // once both have run.
  bool register_post_backward(int64_t unit);
  // Returns whether u's gathered parameters were freed.
  bool post_forward(int64_t unit, bool grad_enabled);
  void pre_backward(int64_t unit);
  void post_backward(int64_t unit);

  // FSDPModule.unshard(): launch u's all-gather now (none where it is gathered or in flight from
  // the current shard; a stale kept copy is freed first) and keep it into the next step (see
  // "Kept gathered"); wait_unshard waits for it.
  void unshard(int64_t unit);
  void wait_unshard(int64_t unit);
  // FSDPModule.set_modules_to_forward_prefetch / set_modules_to_backward_prefetch: the units
  // u's pre_forward (pre_backward) prefetches instead of the next one; nullopt: the default.
  void set_forward_prefetch(int64_t unit, std::optional<std::vector<int64_t>> targets);
  void set_backward_prefetch(int64_t unit, std::optional<std::vector<int64_t>> targets);

  // Free every unit's gathered parameters (after a forward without backward, or by the user).
  void reshard_all();
  // torch FSDP2's reset_iter_state, after a forward or backward raised: waits for what is in
  // flight, then drops this iteration's gradients (unreduced, no_sync's accumulators, HSDP's
  // within-replica partial sums), frees every unit and forgets the step. No collective.
  void reset_iter_state();
  // Free one unit's (FSDPModule.reshard(); a unit kept gathered after backward included).
  void reshard(int64_t unit);

  std::vector<FsdpEvent> trace() const;
  std::vector<int64_t> forward_order() const;
  FsdpMemory memory() const;       // now
  FsdpMemory peak_memory() const;  // highest total seen since reset_peak_memory()
  void reset_peak_memory();

 private:
  struct Unit {
    std::shared_ptr<FlatParam> flat;
    bool trained = false;           // has a parameter that requires grad
    size_t nodes = 0;               // post-backward nodes made this step (one per forward)
    size_t pending = 0;             // of those, the ones still to run this backward
    bool needs_backward = false;    // ran forward with grad this step, not reduced yet
    bool ran_forward = false;       // ran forward with grad this step (a backward may come again)
    bool ran = false;               // its forward ran this step (any grad mode, outside backward)
    bool slot_done = false;         // its place in this backward's collectives is passed
    std::optional<std::vector<int64_t>> forward_prefetch, backward_prefetch;  // set by the user
  };
  struct InFlight {                 // the reduce-scatter (or replicas' all-reduce) running
    int64_t unit = -1;
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor packed, out;
  };

  void post_backward_locked(int64_t unit);
  void advance_stream_locked(size_t to);
  void agree_order_locked();
  bool skipped(int64_t unit) const;
  void complete_slot_locked(int64_t unit);
  void skipped_backward_locked(int64_t unit);
  void start_reduce_scatter_locked(int64_t unit, bool real_grads);
  void finalize();
  void unshard_locked(int64_t unit);
  void prefetch_locked(int64_t unit);
  // Where pre_forward(u) advances the stream to: past the next unit, or past the furthest of the
  // units u lists (see "Explicit prefetching").
  size_t forward_prefetch_end_locked(int64_t unit) const;
  // pre_backward(u)'s prefetch (and a skipped unit's in its place): the next unit in backward
  // order, or every unit from there to the furthest one u lists.
  void prefetch_in_backward_locked(int64_t unit);
  // Whether backward will gather `unit` (so that a prefetch may): it trains, its backward slot
  // is still ahead, and its parameters are read in backward (FlatParam::unshard_in_backward).
  bool gathers_in_backward(int64_t unit) const;
  void check_unit(int64_t unit) const;
  // Free u's gathered parameters (and a post-forward slice); `after_forward`, in a forward a
  // backward follows: free them to u's post-forward slice where u has a post-forward group.
  void reshard_locked(int64_t unit, bool after_forward = false);
  // At the end of u's backward: free it, or keep it gathered (see "Kept gathered").
  void release_after_backward_locked(int64_t unit);
  bool keeps_after_backward(int64_t unit) const;
  // At the root's forward: whether a step begins, and which gathered units every rank keeps
  // (see "Kept gathered").
  struct StepStart {
    bool begin = false;
    std::vector<bool> keep;
  };
  StepStart agree_step_start_locked(bool grad_enabled, bool pending);
  void finish_reduce_scatter_locked();
  void finish_all_reduce_locked();
  // A reduce-scatter's or all-reduce's unit tag in words: "unit 3 ('fc1.weight', ...)".
  std::string describe_tag(double tag) const;
  void begin_step_locked(const std::vector<bool>& keep);
  // Which units ran, and what backward owes them: cleared (a new step, or reset_iter_state).
  void forget_step_locked();
  void record(FsdpEvent::Kind kind, int64_t unit);
  FsdpMemory memory_locked() const;
  // The unit after `unit` in backward order (before it in the agreed forward order, the root
  // left out; for the root, the last unit of forward), or -1.
  int64_t backward_next(int64_t unit) const;

  std::vector<Unit> units_;
  int64_t root_;

  mutable std::mutex mutex_;        // hooks run on autograd's threads
  std::vector<int64_t> order_;      // forward order: this rank's in the first forward, then agreed
  std::vector<int64_t> position_;   // unit -> index in order_, -1 if not run
  bool order_recorded_ = false;     // order_ is the one every rank agreed on
  // The forward all-gathers, in the order every rank issues them (see "Units that run on some
  // ranks only"): every unit in index order in the first forward, then the agreed order_.
  std::vector<int64_t> stream_;
  std::vector<int64_t> stream_pos_; // unit -> index in stream_, -1 if not in it
  size_t cursor_ = 0;               // stream_[0, cursor_) are launched in this forward
  bool step_forward_ = false;       // the forward running began a step
  bool backward_queued_ = false;    // finalize is queued on the running backward
  InFlight in_flight_;
  InFlight all_reduce_;             // hybrid sharding: the replicas' all-reduce running
  std::vector<FsdpEvent> trace_;
  FsdpMemory peak_;
};

}  // namespace torchpar::parallel
