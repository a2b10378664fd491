#include "parallel/fsdp_flat_param.h"

#include "common/step_buffer.h"

#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <sstream>

// _allgather_base / _reduce_scatter_base: renamed all_gather_single / reduce_scatter_single in
// recent torch, the old names kept as deprecated aliases; the old names build against every
// torch the project supports.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace torchpar::parallel {

namespace {

// A tensor of `sizes` at `offset` in `storage`, through a TensorImpl of its own. Unlike set_(),
// this never touches the storage, which may be freed (0 bytes) when the alias is made.
at::Tensor alias(const at::Tensor& like, int64_t offset, at::IntArrayRef sizes) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(like.storage()), like.key_set(), like.dtype());
  std::vector<int64_t> strides(sizes.size(), 1);
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d) {
    strides[d] = strides[d + 1] * sizes[d + 1];
  }
  t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
  return t;
}

// Freeing and refilling a storage in place (its StorageImpl, shared by every tensor on it, stays):
// what lets the tensors autograd saved in forward be valid again in backward.
void free_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));
  s->set_nbytes(0);
}

void allocate_storage(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  // Once per forward and backward, and freed after: a step buffer (huge pages on CPU).
  s->set_data_ptr_noswap(step_buffer_data(nbytes, s->device(), s->allocator()));
  s->set_nbytes(nbytes);
}

std::string describe(const at::Tensor& row) {
  // row: dtype code, requires_grad, ndim, sizes..., or -2 everywhere when the rank has no such parameter
  auto r = row.cpu();
  const int64_t* v = r.data_ptr<int64_t>();
  if (v[0] == -2) return "no such parameter";
  std::ostringstream out;
  out << "shape [";
  for (int64_t d = 0; d < v[2]; ++d) out << (d ? ", " : "") << v[3 + d];
  out << "], " << c10::toString(static_cast<at::ScalarType>(v[0])) << (v[1] ? "" : ", requires_grad=False");
  return out.str();
}

}  // namespace

std::vector<at::Tensor> all_gather_each(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& t) {
  std::vector<at::Tensor> in{t};
  std::vector<std::vector<at::Tensor>> out(1);
  for (int64_t r = 0; r < group->getSize(); ++r) out[0].push_back(at::empty_like(t));
  group->allgather(out, in)->wait();
  return out[0];
}

FlatParam::FlatParam(const std::vector<at::Tensor>& params, std::vector<std::string> names,
                     c10::intrusive_ptr<c10d::ProcessGroup> group, FlatParamOptions options,
                     c10::intrusive_ptr<c10d::ProcessGroup> replicate_group)
    : names_(std::move(names)), group_(std::move(group)), replicate_(std::move(replicate_group)), options_(options) {
  TORCH_CHECK(group_, "torchpar fully_shard: no process group");
  TORCH_CHECK(names_.size() == params.size(), "torchpar fully_shard: ", params.size(), " parameters but ",
              names_.size(), " names");
  world_ = group_->getSize();
  if (replicate_) {
    replicas_ = replicate_->getSize();
    replica_ = replicate_->getRank();
  }
  step_buffers_in_huge_pages();  // a bad TORCHPAR_HUGE_PAGES fails here, not in a forward
  rank_ = group_->getRank();
  // Across ranks first, so that a rank whose model differs fails together with the others. Both
  // groups' checks run before either raises: a replica whose shard group passed would otherwise
  // wait in the replicate group's check for ranks that raised.
  std::string differs = mismatch_across(group_, "rank", params);
  if (replicated()) {
    const at::Device device = params.empty() ? at::Device(at::kCPU) : params[0].device();
    for (std::string other : {misaligned_replicas(device), mismatch_across(replicate_, "replica", params)}) {
      if (differs.empty()) differs = std::move(other);
    }
    // A rank can find nothing wrong in both of its groups while a rank in neither found something
    // (only rank (1, 0)'s model differs: rank (0, 1) shares no group with it). Whether any rank
    // did goes round the shard group, then the replicate group: that reaches every rank of the
    // mesh, so all of them raise (review finding).
    at::Tensor any = at::tensor({differs.empty() ? 0 : 1}, at::TensorOptions().dtype(at::kInt)).to(device);
    for (const auto* g : {&group_, &replicate_}) {
      std::vector<at::Tensor> tensors{any};
      c10d::AllreduceOptions opts;
      opts.reduceOp = c10d::ReduceOp::MAX;
      (*g)->allreduce(tensors, opts)->wait();
    }
    if (differs.empty() && any.cpu().item<int>() != 0) {
      differs = "torchpar fully_shard: the parameters (or the shards the replicate group pairs) differ on ranks "
                "outside this rank's shard and replicate groups; their error names them. Every rank must wrap "
                "the same model.";
    }
  }
  TORCH_CHECK(differs.empty(), differs);

  at::TensorOptions opts = params.empty() ? at::TensorOptions().dtype(at::kFloat) : params[0].options();
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.is_floating_point(), "torchpar fully_shard: parameter '", names_[i], "' is ", p.scalar_type(),
                "; only floating-point parameters can be sharded");
    TORCH_CHECK(p.scalar_type() == params[0].scalar_type() && p.device() == params[0].device(),
                "torchpar fully_shard: one unit holds parameters of one dtype and device, but '", names_[i],
                "' is ", p.scalar_type(), " on ", p.device(), " and '", names_[0], "' ", params[0].scalar_type(),
                " on ", params[0].device(), "; apply fully_shard to a submodule holding one kind");
    shapes_.push_back(p.sizes().vec());
    offsets_.push_back(numel_);
    numels_.push_back(p.numel());
    requires_grad_.push_back(p.requires_grad());
    numel_ += p.numel();
  }
  shard_numel_ = (numel_ + world_ - 1) / world_;
  compute_dtype_ = options_.param_dtype.value_or(opts.dtype().toScalarType());
  reduce_dtype_ = options_.reduce_dtype.value_or(compute_dtype_);

  at::NoGradGuard no_grad;
  shard_ = at::zeros({shard_numel_}, opts.requires_grad(false));  // the padding stays zero
  for (size_t i = 0; i < params.size(); ++i) {
    auto [start, length] = shard_range(i);
    if (length > 0) {
      shard_.narrow(0, offsets_[i] + start - rank_ * shard_numel_, length)
          .copy_(params[i].detach().reshape(-1).narrow(0, start, length));
    }
  }
  full_ = at::empty({padded_numel()}, opts.dtype(compute_dtype_).requires_grad(false));
  // The collective writes through this alias, whose version counter is its own: the parameters'
  // counters (checked when autograd unpacks what it saved) do not move when they are refilled.
  gather_target_ = alias(full_, 0, {padded_numel()});
  free_full();
}

std::pair<int64_t, int64_t> FlatParam::shard_range(size_t i) const {
  const int64_t lo = std::max(offsets_[i], rank_ * shard_numel_);
  const int64_t hi = std::min(offsets_[i] + numels_[i], (rank_ + 1) * shard_numel_);
  return hi > lo ? std::make_pair(lo - offsets_[i], hi - lo) : std::make_pair(int64_t{0}, int64_t{0});
}

std::vector<at::Tensor> FlatParam::shard_views() const {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < size(); ++i) {
    auto [start, length] = shard_range(i);
    const int64_t at = length > 0 ? offsets_[i] + start - rank_ * shard_numel_ : 0;
    out.push_back(shard_.narrow(0, at, length));
  }
  return out;
}

std::vector<at::Tensor> FlatParam::unsharded_views() const {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < size(); ++i) {
    out.push_back(alias(full_, offsets_[i], shapes_[i]).requires_grad_(requires_grad_[i]));
  }
  return out;
}

void FlatParam::bind(std::vector<at::Tensor> sharded, std::vector<at::Tensor> unsharded) {
  TORCH_CHECK(sharded.size() == size() && unsharded.size() == size(), "torchpar fully_shard: bind got ",
              sharded.size(), " and ", unsharded.size(), " parameters for a unit of ", size());
  for (size_t i = 0; i < size(); ++i) {
    TORCH_CHECK(unsharded[i].storage().unsafeGetStorageImpl() == full_.storage().unsafeGetStorageImpl() &&
                    sharded[i].storage().unsafeGetStorageImpl() == shard_.storage().unsafeGetStorageImpl(),
                "torchpar fully_shard: parameter '", names_[i], "' is not on the unit's storage");
  }
  sharded_ = std::move(sharded);
  unsharded_ = std::move(unsharded);
}

bool FlatParam::gathered() const { return padded_numel() == 0 || full_.storage().nbytes() > 0; }

void FlatParam::set_post_forward_group(c10::intrusive_ptr<c10d::ProcessGroup> post_forward_group) {
  post_forward_shard_.reset();
  if (post_forward_group) {
    const int64_t n = post_forward_group->getSize();
    TORCH_CHECK(n > 1 && n < world_ && world_ % n == 0, "torchpar fully_shard: a post-forward group of ", n,
                " ranks; it must divide the unit's group of ", world_, " into groups of more than one rank");
  }
  post_forward_ = std::move(post_forward_group);
}

void FlatParam::start_gather() {
  if (gathered() || gather_work_) {
    return;
  }
  allocate_storage(full_, static_cast<size_t>(padded_numel()) * full_.element_size());
  // The slices a forward kept are as current as the gather they were cut from: after an optimizer
  // step or a load (the same on every rank) they are dropped and the shards gathered instead.
  const bool from_slices = post_forward_shard_.defined() && gather_is_current_ignoring_storage();
  if (from_slices) {
    gather_input_ = std::move(post_forward_shard_);
    gather_work_ = post_forward_->_allgather_base(gather_target_, gather_input_);
    return;
  }
  post_forward_shard_.reset();
  gathered_version_ = static_cast<int64_t>(shard_._version());
  gathered_steps_ = optimizer_steps;
  gather_input_ = compute_dtype_ == shard_.scalar_type() ? shard_ : shard_.to(compute_dtype_);
  gather_work_ = group_->_allgather_base(gather_target_, gather_input_);
}

void FlatParam::wait_gather() {
  if (!gather_work_) {
    return;
  }
  auto work = std::move(gather_work_);
  work->wait();
  gather_input_.reset();
}

bool FlatParam::gathered_and_current() const { return !gather_work_ && gather_is_current(); }

bool FlatParam::gather_is_current() const { return gathered() && gather_is_current_ignoring_storage(); }

bool FlatParam::gather_is_current_ignoring_storage() const {
  return static_cast<int64_t>(shard_._version()) == gathered_version_ && optimizer_steps == gathered_steps_;
}

void FlatParam::free_full() {
  TORCH_CHECK(!gather_work_, "torchpar fully_shard: freeing a unit whose all-gather is in flight");
  post_forward_shard_.reset();
  if (padded_numel() > 0) {
    free_storage(full_);
  }
}

void FlatParam::free_full_to_post_forward() {
  TORCH_CHECK(!gather_work_, "torchpar fully_shard: freeing a unit whose all-gather is in flight");
  at::Tensor slice;
  if (post_forward_ && padded_numel() > 0 && gather_is_current()) {
    const int64_t n = padded_numel() / post_forward_->getSize();
    slice = full_.narrow(0, post_forward_->getRank() * n, n).clone();
  }
  free_full();
  post_forward_shard_ = std::move(slice);
}

at::Tensor FlatParam::empty_packed() const {
  at::Tensor packed = step_buffer_empty(world_ * packed_stride(), shard_.options().dtype(reduce_dtype_));
  // The tag and used slots, and the padding after the last parameter, are zero.
  packed.view({world_, packed_stride()}).narrow(1, shard_numel_, packed_stride() - shard_numel_).zero_();
  const int64_t padding = padded_numel() - numel_;
  if (padding > 0) {
    pack(packed, numel_, at::zeros({padding}, packed.options()), false);
  }
  return packed;
}

void FlatParam::pack(at::Tensor& packed, int64_t offset, const at::Tensor& src, bool add) const {
  const int64_t n = src.numel();
  for (int64_t done = 0; done < n;) {
    const int64_t chunk = (offset + done) / shard_numel_, col = (offset + done) % shard_numel_;
    const int64_t len = std::min(n - done, shard_numel_ - col);
    at::Tensor dst = packed.narrow(0, chunk * packed_stride() + col, len);
    const at::Tensor piece = src.narrow(0, done, len);
    add ? dst.add_(piece) : dst.copy_(piece);
    done += len;
  }
}

void FlatParam::mark_used(at::Tensor& packed, size_t i) const {
  packed.view({world_, packed_stride()}).select(1, used_slot(i)).fill_(1);
}

at::Tensor FlatParam::take_grads() {
  at::NoGradGuard no_grad;
  at::Tensor packed;
  const bool accumulated = accumulator_.defined();
  packed = accumulated ? std::move(accumulator_) : empty_packed();
  for (size_t i = 0; i < size(); ++i) {
    at::Tensor grad = unsharded_.empty() ? at::Tensor() : unsharded_[i].grad();
    if (grad.defined()) {
      pack(packed, offsets_[i], grad.reshape(-1), accumulated);
      mark_used(packed, i);
      unsharded_[i].mutable_grad().reset();
    } else if (!accumulated && numels_[i] > 0) {
      pack(packed, offsets_[i], at::zeros({numels_[i]}, packed.options()), false);
    }
  }
  return packed;
}

void FlatParam::accumulate_grads_locally() {
  at::NoGradGuard no_grad;
  if (!accumulator_.defined()) {
    accumulator_ = at::zeros({world_ * packed_stride()}, shard_.options().dtype(reduce_dtype_));
  }
  for (size_t i = 0; i < unsharded_.size(); ++i) {
    if (unsharded_[i].grad().defined()) {
      pack(accumulator_, offsets_[i], unsharded_[i].grad().reshape(-1), true);
      mark_used(accumulator_, i);
      unsharded_[i].mutable_grad().reset();
    }
  }
}

void FlatParam::set_accumulator(at::Tensor accumulator) {
  if (accumulator.defined()) {
    TORCH_CHECK(accumulator.dim() == 1 && accumulator.numel() == world_ * packed_stride() &&
                    accumulator.scalar_type() == reduce_dtype_ && accumulator.device() == shard_.device() &&
                    accumulator.is_contiguous(),
                "torchpar fully_shard: an accumulator is a contiguous [", world_ * packed_stride(), "] ",
                reduce_dtype_, " tensor on ", shard_.device(), "; got ", accumulator.sizes(), " ",
                accumulator.scalar_type(), " on ", accumulator.device());
  }
  accumulator_ = std::move(accumulator);
}

void FlatParam::discard_unsharded_grads() {
  for (auto& p : unsharded_) {
    p.mutable_grad().reset();
  }
}

std::pair<c10::intrusive_ptr<c10d::Work>, at::Tensor> FlatParam::start_reduce_scatter(at::Tensor& packed,
                                                                                      double tag) {
  const double pre = divide_factors().first;
  if (pre != 1.0) {  // the gradients only, not the tag and used slots
    at::NoGradGuard no_grad;
    packed.view({world_, packed_stride()}).narrow(1, 0, shard_numel_).div_(pre);
  }
  packed.view({world_, packed_stride()}).select(1, shard_numel_ + rank_).fill_(tag);
  // Replicated: room after the reduced chunk for the all-reduce's own slots (start_replica_all_reduce).
  at::Tensor out = at::empty({packed_stride() + (replicated() ? 1 + replicas_ : 0)}, packed.options());
  at::Tensor chunk = out.narrow(0, 0, packed_stride());
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;  // then divided by the world size: gloo has no AVG
  return {group_->_reduce_scatter_base(chunk, packed, opts), out};
}

c10::intrusive_ptr<c10d::Work> FlatParam::start_replica_all_reduce(at::Tensor& out, bool had_grads, double tag) {
  TORCH_CHECK(replicated(), "torchpar fully_shard: the unit has no replicate group");
  at::Tensor slots = out.narrow(0, packed_stride(), 1 + replicas_);
  slots.zero_();
  slots[0] = had_grads ? 1.0 : 0.0;
  slots[1 + replica_] = tag;
  std::vector<at::Tensor> tensors{out};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  return replicate_->allreduce(tensors, opts);
}

FlatParam::ReplicaSlots FlatParam::replica_slots(const at::Tensor& reduced) const {
  at::Tensor v = reduced.narrow(0, packed_stride(), 1 + replicas_).to(at::Device(at::kCPU), at::kDouble);
  const double* d = v.data_ptr<double>();
  return {d[0] > 0, std::vector<double>(d + 1, d + 1 + replicas_)};
}

std::vector<double> FlatParam::reduced_tags(const at::Tensor& reduced) const {
  at::Tensor tags = reduced.narrow(0, shard_numel_, world_).to(at::Device(at::kCPU), at::kDouble);
  const double* v = tags.data_ptr<double>();
  return std::vector<double>(v, v + world_);
}

std::pair<double, double> FlatParam::divide_factors() const {
  const double factor = gradient_divide_factor.value_or(static_cast<double>(world_ * replicas_));
  if (reduce_dtype_ != at::kHalf) {
    return {1.0, factor};
  }
  // float16 (largest finite 65504): the sum of the ranks' gradients can overflow where their
  // mean would not, so divide by about sqrt(factor) (a power of two: exact) before the sum and
  // by the rest after, as torch's FSDP2 does for a reduce dtype at risk of overflow
  // (_get_gradient_divide_factors; FSDP1's gradient_predivide_factor).
  double pre = 1.0;
  while (std::fmod(factor, pre) == 0.0 && factor / pre > pre) {
    pre *= 2.0;
  }
  return {pre, factor / pre};
}

void FlatParam::deliver_grads(const at::Tensor& out) {
  at::NoGradGuard no_grad;
  at::Tensor reduced = out.narrow(0, 0, shard_numel_);
  reduced.div_(divide_factors().second);
  const at::Tensor used = out.narrow(0, used_slot(0), static_cast<int64_t>(size()))
                              .to(at::Device(at::kCPU), at::kDouble).contiguous();
  for (size_t i = 0; i < sharded_.size(); ++i) {
    if (!requires_grad_[i] || used.data_ptr<double>()[i] <= 0) {
      continue;
    }
    auto [start, length] = shard_range(i);
    at::Tensor g = reduced.narrow(0, length > 0 ? offsets_[i] + start - rank_ * shard_numel_ : 0, length);
    if (g.scalar_type() != shard_.scalar_type()) {
      g = g.to(shard_.scalar_type());
    }
    at::Tensor& grad = sharded_[i].mutable_grad();
    if (grad.defined()) {
      grad.add_(g);
    } else {
      grad = g;
    }
  }
}

std::vector<at::Tensor> FlatParam::gather_full_params() {
  at::NoGradGuard no_grad;
  at::Tensor flat = at::empty({padded_numel()}, shard_.options());
  if (padded_numel() > 0) {
    group_->_allgather_base(flat, shard_)->wait();
  }
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < size(); ++i) {
    out.push_back(flat.narrow(0, offsets_[i], numels_[i]).view(shapes_[i]).clone());
  }
  return out;
}

void FlatParam::load_full_param(size_t i, const at::Tensor& value) {
  TORCH_CHECK(i < size(), "torchpar fully_shard: no parameter ", i);
  TORCH_CHECK(value.sizes() == at::IntArrayRef(shapes_[i]), "torchpar fully_shard: the state_dict's '", names_[i],
              "' has shape ", value.sizes(), " but the model's parameter has ", at::IntArrayRef(shapes_[i]));
  at::NoGradGuard no_grad;
  post_forward_shard_.reset();
  auto [start, length] = shard_range(i);
  if (length > 0) {
    shard_.narrow(0, offsets_[i] + start - rank_ * shard_numel_, length)
        .copy_(value.detach().reshape(-1).narrow(0, start, length));
  }
}

int64_t FlatParam::shard_bytes() const { return static_cast<int64_t>(shard_.nbytes()); }

int64_t FlatParam::full_bytes() const {
  int64_t bytes = static_cast<int64_t>(full_.storage().nbytes());
  if (post_forward_shard_.defined()) {
    bytes += static_cast<int64_t>(post_forward_shard_.nbytes());
  }
  if (gather_input_.defined() && !gather_input_.is_same(shard_)) {
    bytes += static_cast<int64_t>(gather_input_.nbytes());
  }
  return bytes;
}

int64_t FlatParam::unsharded_grad_bytes() const {
  int64_t bytes = 0;
  for (const auto& p : unsharded_) {
    if (p.grad().defined()) bytes += static_cast<int64_t>(p.grad().nbytes());
  }
  return bytes;
}

int64_t FlatParam::accumulator_bytes() const {
  return (accumulator_.defined() ? static_cast<int64_t>(accumulator_.nbytes()) : 0) +
         (partial_.defined() ? static_cast<int64_t>(partial_.nbytes()) : 0);
}

void FlatParam::add_partial(const at::Tensor& reduced) {
  at::NoGradGuard no_grad;
  at::Tensor chunk = reduced.narrow(0, 0, packed_stride());
  if (partial_.defined()) {
    partial_.add_(chunk);
  } else {
    partial_ = chunk.clone();
  }
  partial_.narrow(0, shard_numel_, world_).zero_();  // the tags are each reduce-scatter's own
}

bool FlatParam::take_partial(at::Tensor& out) {
  if (!partial_.defined()) {
    return false;
  }
  at::NoGradGuard no_grad;
  out.narrow(0, 0, packed_stride()).add_(partial_);  // the gradients, and how many ranks had each
  partial_.reset();
  return true;
}

int64_t FlatParam::sharded_grad_bytes(std::vector<const void*>& seen) const {
  int64_t bytes = 0;
  for (const auto& p : sharded_) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    const void* key = g.storage().unsafeGetStorageImpl();
    if (std::find(seen.begin(), seen.end(), key) == seen.end()) {
      seen.push_back(key);
      bytes += static_cast<int64_t>(g.storage().nbytes());
    }
  }
  return bytes;
}

std::string FlatParam::misaligned_replicas(const at::Device& device) const {
  // Every member of the replicate group must hold the same shard (position and count): the
  // all-reduce sums shard `rank_` of each replica, and a group pairing other positions would sum
  // unrelated elements without any other sign.
  at::Tensor mine = at::tensor({world_, rank_}, at::TensorOptions().dtype(at::kLong));
  const std::vector<at::Tensor> all = all_gather_each(replicate_, mine.to(device));
  for (int64_t r = 0; r < replicas_; ++r) {
    at::Tensor theirs = all[r].cpu();
    if (!at::equal(theirs, mine)) {
      std::ostringstream msg;
      msg << "torchpar fully_shard: the replicate group pairs ranks that hold different shards: replica "
          << replica_ << " holds shard " << rank_ << " of " << world_ << ", replica " << r << " holds shard "
          << theirs[1].item<int64_t>() << " of " << theirs[0].item<int64_t>()
          << ". Each replicate group takes the ranks at one position of every shard group (a mesh of shape "
             "(replicate, shard) makes them so).";
      return msg.str();
    }
  }
  return "";
}

std::string FlatParam::mismatch_across(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const char* member,
                                       const std::vector<at::Tensor>& params) const {
  const at::Device device = params.empty() ? at::Device(at::kCPU) : params[0].device();
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  const int64_t size = group->getSize();
  int64_t ndim = 0;
  for (const auto& p : params) ndim = std::max<int64_t>(ndim, p.dim());
  auto all_gather = [&](const at::Tensor& t) {
    std::vector<at::Tensor> out = all_gather_each(group, t.to(device));
    for (auto& o : out) o = o.cpu();
    return out;
  };
  auto heads = all_gather(at::tensor({static_cast<int64_t>(params.size()), ndim}, i64));
  int64_t rows = 0, width = 0;
  for (const auto& h : heads) {
    rows = std::max(rows, h[0].item<int64_t>());
    width = std::max(width, 3 + h[1].item<int64_t>());
  }
  at::Tensor sig = at::full({rows, width}, -2, i64);
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    sig[i].fill_(-1);
    sig[i][0] = static_cast<int64_t>(p.scalar_type());
    sig[i][1] = static_cast<int64_t>(p.requires_grad());
    sig[i][2] = p.dim();
    for (int64_t d = 0; d < p.dim(); ++d) sig[i][3 + d] = p.size(d);
  }
  auto sigs = all_gather(sig);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t r = 1; r < size; ++r) {
      if (!at::equal(sigs[r][i], sigs[0][i])) {
        const std::string name = i < static_cast<int64_t>(params.size()) ? names_[i] : "#" + std::to_string(i);
        std::ostringstream msg;
        msg << "torchpar fully_shard: the parameters differ across " << member << "s at parameter " << i << " ('"
            << name << "' on " << member << " " << group->getRank() << "): " << member << " 0 has "
            << describe(sigs[0][i]) << ", " << member << " " << r << " has " << describe(sigs[r][i]) << " ("
            << heads[0][0].item<int64_t>() << " and " << heads[r][0].item<int64_t>()
            << " parameters in this unit). Every rank must wrap the same model.";
        return msg.str();
      }
    }
  }
  return "";
}

}  // namespace torchpar::parallel
