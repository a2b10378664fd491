// One fully_shard unit's parameters as a flat parameter (ZeRO-3; Rajbhandari et al. 2020,
// arXiv:1910.02054; FSDP, Zhao et al. 2023, arXiv:2304.11277; issue 19).
//
// The unit's parameters are laid back to back in one flat vector, padded at the end so that it
// divides into world_size equal shards. Rank r keeps shard r in the master dtype (`shard_`); what
// the user and the optimizer see of parameter i is the piece of it inside shard r: a 1-D view of
// `shard_` (possibly empty). For forward and backward the shards are all-gathered into `full`
// storage (in the compute dtype), of which each parameter has a full-shaped tensor; freeing that
// storage (resizing it to 0 bytes) and refilling it later keeps the same tensors valid, so the
// ones autograd saved in forward read the refilled values in backward.
//
// FlatParam knows the layout and moves bytes; when to gather, free and reduce is fsdp_engine.h's.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace torchpar::parallel {

// Every member's `t` (same shape on each), in group rank order, on t's device: one all-gather,
// waited on (the units' set-up checks and order agreement).
std::vector<at::Tensor> all_gather_each(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& t);

struct FlatParamOptions {
  // dtype of the gathered parameters that forward and backward compute with; nullopt: the
  // parameters' own (the master dtype).
  std::optional<at::ScalarType> param_dtype;
  // dtype gradients are packed and reduce-scattered in; nullopt: the compute dtype.
  std::optional<at::ScalarType> reduce_dtype;
  bool reshard_after_forward = true;
};

class FlatParam {
 public:
  // `params` are the unit's distinct parameters, full and identical in shape and dtype on every
  // rank (checked here, with collectives, naming the first that differs); `names` their names
  // for messages. `group` shards them. `replicate_group` (optional; hybrid sharding, HSDP): the
  // ranks that hold the same shard in the other replicas of the model, over which each reduced
  // shard of gradients is then all-reduced (see start_replica_all_reduce).
  FlatParam(const std::vector<at::Tensor>& params, std::vector<std::string> names,
            c10::intrusive_ptr<c10d::ProcessGroup> group, FlatParamOptions options,
            c10::intrusive_ptr<c10d::ProcessGroup> replicate_group = {});

  FlatParam(const FlatParam&) = delete;
  FlatParam& operator=(const FlatParam&) = delete;

  // ---- layout ----
  size_t size() const { return names_.size(); }
  const std::string& name(size_t i) const { return names_[i]; }
  int64_t world_size() const { return world_; }
  int64_t rank() const { return rank_; }
  int64_t numel() const { return numel_; }              // without padding
  int64_t padded_numel() const { return shard_numel_ * world_; }
  int64_t shard_numel() const { return shard_numel_; }
  // Parameter i's elements in the flat vector: [offset, offset + numel).
  int64_t offset(size_t i) const { return offsets_[i]; }
  // Parameter i's part of this rank's shard: [start, start + length) of its flattened elements.
  std::pair<int64_t, int64_t> shard_range(size_t i) const;
  const std::vector<int64_t>& shape(size_t i) const { return shapes_[i]; }
  at::ScalarType master_dtype() const { return shard_.scalar_type(); }
  at::Device device() const { return shard_.device(); }
  const c10::intrusive_ptr<c10d::ProcessGroup>& group() const { return group_; }
  // Hybrid sharding: a replicate group of more than one rank (else null, or of size 1).
  bool replicated() const { return replicas_ > 1; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& replicate_group() const { return replicate_; }
  int64_t replicas() const { return replicas_; }
  int64_t replica() const { return replica_; }
  at::ScalarType compute_dtype() const { return compute_dtype_; }
  at::ScalarType reduce_dtype() const { return reduce_dtype_; }
  const FlatParamOptions& options() const { return options_; }
  // Set between steps (FSDPModule.set_reshard_after_forward), never while a forward runs; a
  // bool, so it also drops the post-forward group (as torch's FSDP2 does).
  void set_reshard_after_forward(bool reshard) {
    options_.reshard_after_forward = reshard;
    post_forward_.reset();
    post_forward_shard_.reset();
  }
  // fully_shard(reshard_after_forward=N): the group of N ranks (N dividing the world size, e.g.
  // the ranks of one host) among which a forward leaves the unit sharded, so that its backward
  // all-gathers over those N only (torch FSDP2's int reshard_after_forward; ZeRO++'s hierarchical
  // partitioning, Wang et al. 2023, arXiv:2306.10209). Each keeps 1/N of the gathered vector in
  // the compute dtype: slice `post_forward_group->getRank()`. Null: reshard over the whole group.
  void set_post_forward_group(c10::intrusive_ptr<c10d::ProcessGroup> post_forward_group);
  const c10::intrusive_ptr<c10d::ProcessGroup>& post_forward_group() const { return post_forward_; }

  // ---- tensors handed to Python once, which wraps them in nn.Parameter and binds them ----
  // Parameter i's piece of this rank's shard, a 1-D view of the master shard.
  std::vector<at::Tensor> shard_views() const;
  // Parameter i full-shaped on the gathered storage (leaves; requires_grad as the original).
  std::vector<at::Tensor> unsharded_views() const;
  // The nn.Parameter objects made from those: the ones the optimizer steps (sharded) and the ones
  // forward uses (unsharded). Their storages are the ones above.
  void bind(std::vector<at::Tensor> sharded, std::vector<at::Tensor> unsharded);
  const std::vector<at::Tensor>& sharded_params() const { return sharded_; }
  const std::vector<at::Tensor>& unsharded_params() const { return unsharded_; }

  // ---- parameters: gather and free ----
  bool gathered() const;                  // the full storage holds memory
  void start_gather();                    // allocate it and launch the all-gather (async)
  bool gather_in_flight() const { return static_cast<bool>(gather_work_); }
  void wait_gather();
  void free_full();                       // release the full storage (reshard)
  // After a forward with a post-forward group: keep this rank's slice of the gathered vector
  // (where it is of the current shard), then free the full storage. The next start_gather
  // all-gathers the slices over the post-forward group, not the shards over the group.
  void free_full_to_post_forward();
  bool holds_post_forward() const { return post_forward_shard_.defined(); }
  void drop_post_forward() { post_forward_shard_.reset(); }
  // Gathered, and the shard not written since its gather started: no optimizer step over it
  // (optimizer_steps), no in-place write that bumps its version counter (a checkpoint load); a
  // write through `.data`, which has a counter of its own, is not seen.
  bool gathered_and_current() const;
  // The same, with the all-gather possibly still in flight.
  bool gather_is_current() const;

  // ---- gradients ----
  // The unit's unsharded gradients packed in the reduce dtype (padded, zeros where a parameter
  // got none), plus what no_sync steps accumulated; each unsharded .grad is released as it is
  // copied, so that the packed copy and the gradients are not both whole at once.
  at::Tensor take_grads();
  // no_sync: add the unsharded gradients into the local accumulator instead (full size, reduce
  // dtype), releasing them.
  void accumulate_grads_locally();
  // Release the unsharded gradients unreduced (left by a backward that raised).
  void discard_unsharded_grads();
  // Reduce-scatter `packed` (sum) into this rank's shard; returns the work and the output.
  // Packed gradients are laid out as world_size chunks of shard_numel elements, each followed by
  // world_size tag slots: this rank writes `tag` into slot `rank` of every chunk (the others stay
  // zero), so after the sum each rank reads every rank's tag exactly (one non-zero term per slot)
  // and can tell whether all of them reduced the same unit (reduced_tags). `tag` must be an
  // integer the reduce dtype represents exactly. After the tags, one slot per parameter, 1 in
  // every chunk where this rank has a gradient for it: summed, how many ranks had one, so that a
  // parameter no rank used keeps its .grad as one process leaves it (None stays None; as torch's
  // DDP, and FSDP2 where no rank has a gradient), instead of receiving zeros that an optimizer
  // with weight decay or momentum would step on.
  std::pair<c10::intrusive_ptr<c10d::Work>, at::Tensor> start_reduce_scatter(at::Tensor& packed, double tag);
  // The tags of a finished reduce-scatter's output, one per rank.
  std::vector<double> reduced_tags(const at::Tensor& reduced) const;
  // Hybrid sharding: all-reduce (sum) a finished reduce-scatter's output over the replicate
  // group (async). Its slots after the reduced chunk carry, like the reduce-scatter's tags,
  // whether this replica's shard group had gradients (summed: how many did) and `tag` in slot
  // `replica`, so that each rank reads every replica's unit exactly (replica_slots).
  c10::intrusive_ptr<c10d::Work> start_replica_all_reduce(at::Tensor& out, bool had_grads, double tag);
  struct ReplicaSlots {
    bool any_grads;            // some replica had gradients for the unit
    std::vector<double> tags;  // each replica's unit tag
  };
  ReplicaSlots replica_slots(const at::Tensor& reduced) const;
  // Divide the summed shard by the number of ranks that summed it (the world size, times the
  // replicas under hybrid sharding), or by gradient_divide_factor where set (for float16, the
  // part of it not divided before the reduce-scatter), and hand it to the
  // sharded parameters' .grad (assigned as views of `reduced` when .grad is undefined, added
  // otherwise), but for parameters no rank had a gradient for (their .grad is left as it is).
  void deliver_grads(const at::Tensor& reduced);
  // (divided by before the reduce-scatter, after it): (1, the divide factor) but for float16,
  // which is split around the sum (divide_factors in the .cpp says why).
  std::pair<double, double> divide_factors() const;
  // torch FSDP2's set_gradient_divide_factor: what the sum over the ranks is divided by instead
  // (1: the sum itself, e.g. for a loss that is a sum over tokens normalised by hand).
  std::optional<double> gradient_divide_factor;
  bool has_accumulator() const { return accumulator_.defined(); }
  // no_sync's local sum (undefined while there is none). A pipeline step that raised puts back
  // the one it found, so its partial sums are not reduced by the next step (schedules.py).
  const at::Tensor& accumulator() const { return accumulator_; }
  void set_accumulator(at::Tensor accumulator);
  bool requires_grad_sync = true;
  // Hybrid sharding, false (torch FSDP2's set_requires_all_reduce): a backward reduce-scatters
  // within the shard group and keeps the result in a sharded partial sum instead of all-reducing
  // it across the replicas; the next all-reduce adds it in (add_partial / take_partial).
  bool requires_all_reduce = true;
  void add_partial(const at::Tensor& reduced);
  // Add the kept partial sum into a reduce-scatter output and drop it; whether there was one.
  bool take_partial(at::Tensor& out);
  void discard_partial() { partial_.reset(); }
  // False: a backward that does not sync gradients (no_sync, a pipeline's earlier micro-batches)
  // leaves the unit gathered for the next forward and backward, which then skip its all-gather
  // (fsdp_engine.h, "Kept gathered"). A syncing backward frees it whatever this says.
  bool reshard_after_backward = true;
  // torch FSDP2's set_unshard_in_backward(False): the unit's parameters are not read by its
  // backward (an embedding's gradient needs the indices only), so its pre-backward gathers
  // nothing and no backward prefetch gathers it; the gradients still reduce as always.
  bool unshard_in_backward = true;
  // Optimizer steps taken over this unit's sharded parameters (counted by a torch.optim step
  // hook, torchpar/parallel/fsdp.py): a gathered copy from before a step is not current.
  int64_t optimizer_steps = 0;
  // FSDPModule.unshard() gathered the unit ahead of its forward: the next step's start keeps it
  // where its gather is current (fsdp_engine.h, "Kept gathered"), instead of freeing it.
  bool unshard_requested = false;

  // ---- checkpoints ----
  // Every parameter full-shaped in the master dtype (a collective: every rank calls it).
  std::vector<at::Tensor> gather_full_params();
  // Copy this rank's piece of parameter i out of the full tensor `value` (no communication); drops
  // a post-forward slice (on every rank, whether or not its piece is empty).
  void load_full_param(size_t i, const at::Tensor& value);

  // ---- memory the unit holds now, in bytes, by kind ----
  int64_t shard_bytes() const;
  int64_t full_bytes() const;             // gathered storage (+ the cast shard being sent, a post-forward slice)
  int64_t unsharded_grad_bytes() const;
  int64_t accumulator_bytes() const;
  // Storages behind the sharded parameters' .grad, added to `seen` (shared storages once).
  int64_t sharded_grad_bytes(std::vector<const void*>& seen) const;

 private:
  // The first parameter whose shape, dtype or requires_grad differs across the members of
  // `group` ("rank" or "replica" in the message), or "" (two all-gathers).
  std::string mismatch_across(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const char* member,
                              const std::vector<at::Tensor>& params) const;
  // Hybrid sharding: a message where the replicate group's members hold different shards (their
  // shard rank or shard group size differ), or "" (one all-gather over the replicate group).
  std::string misaligned_replicas(const at::Device& device) const;
  // The shard not written since the last gather began (whether or not the full storage is held).
  bool gather_is_current_ignoring_storage() const;
  // A packed gradient buffer (see start_reduce_scatter): chunk stride, and `src` (flat) written
  // (or added) at flat offset `offset`, split at the chunk boundaries.
  int64_t packed_stride() const { return shard_numel_ + world_ + static_cast<int64_t>(size()); }
  int64_t used_slot(size_t i) const { return shard_numel_ + world_ + static_cast<int64_t>(i); }
  // Mark parameter i as having a gradient on this rank, in every chunk of `packed`.
  void mark_used(at::Tensor& packed, size_t i) const;
  at::Tensor empty_packed() const;
  void pack(at::Tensor& packed, int64_t offset, const at::Tensor& src, bool add) const;

  std::vector<std::string> names_;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<int64_t> offsets_;
  std::vector<int64_t> numels_;
  std::vector<bool> requires_grad_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  c10::intrusive_ptr<c10d::ProcessGroup> replicate_;  // hybrid sharding, or null
  FlatParamOptions options_;
  int64_t world_ = 1, rank_ = 0;
  int64_t replicas_ = 1, replica_ = 0;
  int64_t numel_ = 0, shard_numel_ = 0;
  at::ScalarType compute_dtype_, reduce_dtype_;

  at::Tensor shard_;          // this rank's shard, master dtype, [shard_numel]
  at::Tensor full_;           // [padded_numel], compute dtype; its storage is freed and refilled
  at::Tensor gather_target_;  // full_'s storage through its own TensorImpl (see start_gather)
  at::Tensor gather_input_;   // the shard in the compute dtype (or a post-forward slice) while the gather runs
  c10::intrusive_ptr<c10d::ProcessGroup> post_forward_;  // see set_post_forward_group, or null
  at::Tensor post_forward_shard_;  // [padded_numel / N], compute dtype, held from forward to backward
  c10::intrusive_ptr<c10d::Work> gather_work_;
  int64_t gathered_version_ = -1;  // shard_'s version counter when the last gather started
  int64_t gathered_steps_ = -1;    // optimizer_steps then
  at::Tensor accumulator_;    // no_sync's local gradient sum, packed, reduce dtype
  at::Tensor partial_;        // requires_all_reduce false: the shard group's sums, [packed_stride]
  std::vector<at::Tensor> sharded_, unsharded_;
};

}  // namespace torchpar::parallel
