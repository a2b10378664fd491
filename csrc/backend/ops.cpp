#include "backend/ops.h"

#include <algorithm>
#include <string>
#include <type_traits>
#include <utility>

#include "backend/sparse.h"
#include "backend/tensors.h"
#include "collectives/collectives.h"

namespace torchpar::ops {
namespace {

std::vector<void*> data_ptrs(const std::vector<Staged>& staged) {
  std::vector<void*> out;
  for (auto& s : staged) out.push_back(s.data());
  return out;
}

// Rank r's piece of a flat buffer of `size` equal pieces of `bytes` each.
template <typename Ptr>
std::vector<Ptr> pieces(Ptr base, size_t bytes, int size) {
  std::vector<Ptr> out;
  using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<Ptr>>, const char, char>;
  for (int r = 0; r < size; ++r) out.push_back(static_cast<Byte*>(base) + r * bytes);
  return out;
}

size_t bytes_of(const Staged& s) { return s.count() * s.buffer.element_size(); }

// Rows per split of dim 0, as elements, for all_to_all_single; empty splits mean even.
std::vector<size_t> split_counts(const at::Tensor& t, const std::vector<int64_t>& splits, int size,
                                 const char* what) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const size_t row = rows == 0 ? 0 : static_cast<size_t>(t.numel() / rows);
  std::vector<size_t> counts(size);
  if (splits.empty()) {
    TORCH_CHECK(rows % size == 0, "torchpar all_to_all: ", what, " has ", rows,
                " rows in dim 0, which does not divide evenly among ", size, " ranks; pass split sizes");
    for (auto& c : counts) c = static_cast<size_t>(rows / size) * row;
    return counts;
  }
  TORCH_CHECK(static_cast<int>(splits.size()) == size, "torchpar all_to_all: ", what, " split sizes have ",
              splits.size(), " entries for a group of size ", size);
  int64_t total = 0;
  for (int r = 0; r < size; ++r) {
    TORCH_CHECK(splits[r] >= 0, "torchpar all_to_all: negative ", what, " split size ", splits[r]);
    total += splits[r];
    counts[r] = static_cast<size_t>(splits[r]) * row;
  }
  TORCH_CHECK(total == rows, "torchpar all_to_all: ", what, " split sizes sum to ", total, " but dim 0 has ",
              rows, " rows");
  return counts;
}

// Contiguous, not lazily conjugated or negated, and no two sharing memory: then each tensor
// can be reduced where it lies (an aliased pair would read one reduction's result as the
// other's input).
bool reducible_in_place(const std::vector<at::Tensor>& ts) {
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  for (const auto& t : ts) {
    if (!t.is_contiguous() || t.is_conj() || t.is_neg()) return false;
    if (t.nbytes() == 0) continue;
    const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
    spans.emplace_back(begin, begin + t.nbytes());
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) return false;
  }
  return true;
}

}  // namespace

// ---------------------------------------------------------------------------------------

Broadcast::Broadcast(const std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts, int rank,
                     int size) {
  check_single(tensors, kName);
  check_rank(static_cast<int>(opts.rootRank), size, kName, "root");
  t = tensors[0];
  root = static_cast<int>(opts.rootRank);
  if (rank != root) check_writable(t, kName, "tensor");
}

void Broadcast::run(Comm& c) const {
  const bool sending = c.rank() == root;
  Staged s = sending ? Staged::input(t) : Staged::output(t);
  collectives::broadcast(c, s.data(), s.count(), s.dtype(), root);
  if (!sending) s.finish();  // the root's tensor is only read (it may be an expanded or a read-only view)
}

Allreduce::Allreduce(const std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts, int, int) {
  check_single(tensors, kName);
  check_writable(tensors[0], kName, "tensor");
  t = tensors[0];
  op = reduce_op(opts.reduceOp, kName, t.scalar_type());
  user_op = opts.reduceOp;
}

void Allreduce::run(Comm& c) const {
  Staged s = Staged::input(premultiply(t, user_op));
  s.user = t;
  collectives::allreduce(c, s.data(), s.count(), s.dtype(), op);
  s.finish();
}

SparseAllreduce::SparseAllreduce(const std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts, int,
                                 int) {
  TORCH_CHECK(tensors.size() == 1, "torchpar all_reduce: expects exactly one tensor per call, got ", tensors.size());
  t = tensors[0];
  check_sparse_allreduce(t, opts.reduceOp);
}

void SparseAllreduce::run(Comm& c) const { sparse_allreduce_sum(c, t); }

AllreduceCoalesced::AllreduceCoalesced(const std::vector<at::Tensor>& tensors,
                                       const c10d::AllreduceCoalescedOptions& opts, int, int) {
  check_tensors(tensors, kName, "tensors");
  check_writable(tensors, kName, "tensors");
  TORCH_CHECK(!tensors.empty(), "torchpar all_reduce_coalesced: no tensors");
  for (auto& t : tensors) {
    TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type(),
                "torchpar all_reduce_coalesced: all tensors must have one dtype, got ",
                tensors[0].scalar_type(), " and ", t.scalar_type());
  }
  op = reduce_op(opts.reduceOp, kName, tensors[0].scalar_type());
  user_op = opts.reduceOp;
  ts = tensors;
  in_place = user_op != c10d::ReduceOp::PREMUL_SUM && reducible_in_place(ts);
}

void AllreduceCoalesced::run(Comm& c) const {
  if (in_place) {
    // One collective over the tensors where they lie: no flat copy to pack and unpack.
    collectives::Segments data;
    size_t count = 0;
    for (const auto& t : ts) {
      const Staged s = Staged::output(t);  // the tensor itself (complex as real pairs)
      data.add(s.data(), bytes_of(s));
      count += s.count();
    }
    collectives::allreduce(c, data, count, Staged::output(ts[0]).dtype(), op);
    return;
  }
  // One flat buffer, one collective: W small all-reduces would pay W synchronisations.
  std::vector<at::Tensor> flat;
  for (auto& t : ts) flat.push_back(premultiply(t, user_op).reshape({-1}));
  Staged s = Staged::input(at::cat(flat));
  collectives::allreduce(c, s.data(), s.count(), s.dtype(), op);
  int64_t off = 0;
  for (auto t : ts) {
    write_back(t, s.user.narrow(0, off, t.numel()).view(t.sizes()));
    off += t.numel();
  }
}

Reduce::Reduce(const std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts, int rank, int size) {
  check_single(tensors, kName);
  check_rank(static_cast<int>(opts.rootRank), size, kName, "root");
  if (rank == opts.rootRank) check_writable(tensors[0], kName, "tensor");
  t = tensors[0];
  op = reduce_op(opts.reduceOp, kName, t.scalar_type());
  user_op = opts.reduceOp;
  root = static_cast<int>(opts.rootRank);
}

void Reduce::run(Comm& c) const {
  Staged s = Staged::input(premultiply(t, user_op));  // written on the root only
  s.user = t;
  collectives::reduce(c, s.data(), s.count(), s.dtype(), op, root);
  if (c.rank() == root) s.finish();
}

Allgather::Allgather(const std::vector<std::vector<at::Tensor>>& outputs, const std::vector<at::Tensor>& inputs,
                     const c10d::AllgatherOptions&, int, int size) {
  check_single(inputs, kName);
  TORCH_CHECK(outputs.size() == 1, "torchpar all_gather: expects one output list, got ", outputs.size());
  TORCH_CHECK(static_cast<int>(outputs[0].size()) == size, "torchpar all_gather: the output list has ",
              outputs[0].size(), " tensors for a group of size ", size);
  check_tensors(outputs[0], kName, "output");
  check_writable(outputs[0], kName, "output");
  for (size_t r = 0; r < outputs[0].size(); ++r) {
    check_same_type_and_size(inputs[0], outputs[0][r], kName, "output[" + std::to_string(r) + "]");
  }
  in = inputs[0];
  outs = outputs[0];
}

void Allgather::run(Comm& c) const {
  Staged s = Staged::input(in);
  std::vector<Staged> staged;
  for (auto& o : outs) staged.push_back(Staged::output(o));
  auto ptrs = data_ptrs(staged);
  collectives::allgather(c, s.data(), ptrs.data(), s.count(), s.dtype());
  for (auto& o : staged) o.finish();
}

AllgatherIntoTensor::AllgatherIntoTensor(const at::Tensor& output, const at::Tensor& input,
                                         const c10d::AllgatherOptions&, int, int size) {
  check_tensor(input, kName, "input");
  check_tensor(output, kName, "output");
  check_writable(output, kName, "output");
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "torchpar all_gather_into_tensor: output dtype ",
              output.scalar_type(), " differs from input dtype ", input.scalar_type());
  TORCH_CHECK(output.numel() == input.numel() * size, "torchpar all_gather_into_tensor: output has ",
              output.numel(), " elements; expected world size (", size, ") x input (", input.numel(), ")");
  in = input;
  out = output;
}

void AllgatherIntoTensor::run(Comm& c) const {
  Staged s = Staged::input(in);
  Staged o = Staged::output(out);
  auto ptrs = pieces(o.data(), bytes_of(s), c.size());
  collectives::allgather(c, s.data(), ptrs.data(), s.count(), s.dtype());
  o.finish();
}

Gather::Gather(const std::vector<std::vector<at::Tensor>>& outputs, const std::vector<at::Tensor>& inputs,
               const c10d::GatherOptions& opts, int rank, int size) {
  check_single(inputs, kName);
  root = static_cast<int>(opts.rootRank);
  check_rank(root, size, kName, "root");
  if (rank == root) {
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size,
                "torchpar gather: the root needs one list of ", size, " output tensors");
    check_tensors(outputs[0], kName, "output");
    check_writable(outputs[0], kName, "output");
    for (size_t r = 0; r < outputs[0].size(); ++r) {
      check_same_type_and_size(inputs[0], outputs[0][r], kName, "output[" + std::to_string(r) + "]");
    }
    outs = outputs[0];
  } else {
    TORCH_CHECK(outputs.empty() || outputs[0].empty(), "torchpar gather: only the root (rank ", root,
                ") takes output tensors");
  }
  in = inputs[0];
}

void Gather::run(Comm& c) const {
  Staged s = Staged::input(in);
  std::vector<Staged> staged;
  for (auto& o : outs) staged.push_back(Staged::output(o));
  auto ptrs = data_ptrs(staged);
  if (ptrs.empty()) ptrs.resize(c.size(), nullptr);
  collectives::gather(c, s.data(), ptrs.data(), s.count(), s.dtype(), root);
  for (auto& o : staged) o.finish();
}

Scatter::Scatter(const std::vector<at::Tensor>& outputs, const std::vector<std::vector<at::Tensor>>& inputs,
                 const c10d::ScatterOptions& opts, int rank, int size) {
  check_single(outputs, kName);
  check_writable(outputs[0], kName, "output");
  root = static_cast<int>(opts.rootRank);
  check_rank(root, size, kName, "root");
  if (rank == root) {
    TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size,
                "torchpar scatter: the root needs one list of ", size, " input tensors");
    check_tensors(inputs[0], kName, "input");
    for (size_t r = 0; r < inputs[0].size(); ++r) {
      check_same_type_and_size(outputs[0], inputs[0][r], kName, "input[" + std::to_string(r) + "]");
    }
    ins = inputs[0];
  } else {
    TORCH_CHECK(inputs.empty() || inputs[0].empty(), "torchpar scatter: only the root (rank ", root,
                ") takes input tensors");
  }
  out = outputs[0];
}

void Scatter::run(Comm& c) const {
  Staged o = Staged::output(out);
  std::vector<Staged> staged;
  for (auto& i : ins) staged.push_back(Staged::input(i));
  std::vector<const void*> ptrs(c.size(), nullptr);
  for (size_t r = 0; r < staged.size(); ++r) ptrs[r] = staged[r].data();
  collectives::scatter(c, ptrs.data(), o.data(), o.count(), o.dtype(), root);
  o.finish();
}

ReduceScatter::ReduceScatter(const std::vector<at::Tensor>& outputs,
                             const std::vector<std::vector<at::Tensor>>& inputs,
                             const c10d::ReduceScatterOptions& opts, int, int size) {
  check_single(outputs, kName);
  check_writable(outputs[0], kName, "output");
  TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size,
              "torchpar reduce_scatter: expects one list of ", size, " input tensors");
  check_tensors(inputs[0], kName, "input");
  for (size_t r = 0; r < inputs[0].size(); ++r) {
    check_same_type_and_size(outputs[0], inputs[0][r], kName, "input[" + std::to_string(r) + "]");
  }
  out = outputs[0];
  op = reduce_op(opts.reduceOp, kName, out.scalar_type());
  user_op = opts.reduceOp;
  ins = inputs[0];
}

void ReduceScatter::run(Comm& c) const {
  Staged o = Staged::output(out);
  std::vector<Staged> staged;
  for (auto& i : ins) staged.push_back(Staged::input(premultiply(i, user_op)));
  std::vector<const void*> ptrs;
  for (auto& s : staged) ptrs.push_back(s.data());
  collectives::reduce_scatter(c, ptrs.data(), o.data(), o.count(), o.dtype(), op);
  o.finish();
}

ReduceScatterTensor::ReduceScatterTensor(const at::Tensor& output, const at::Tensor& input,
                                         const c10d::ReduceScatterOptions& opts, int, int size) {
  check_tensor(input, kName, "input");
  check_tensor(output, kName, "output");
  check_writable(output, kName, "output");
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "torchpar reduce_scatter_tensor: output dtype ",
              output.scalar_type(), " differs from input dtype ", input.scalar_type());
  TORCH_CHECK(input.numel() == output.numel() * size, "torchpar reduce_scatter_tensor: input has ",
              input.numel(), " elements; expected world size (", size, ") x output (", output.numel(), ")");
  op = reduce_op(opts.reduceOp, kName, output.scalar_type());
  user_op = opts.reduceOp;
  in = input;
  out = output;
}

void ReduceScatterTensor::run(Comm& c) const {
  Staged s = Staged::input(premultiply(in, user_op));
  Staged o = Staged::output(out);
  auto ptrs = pieces(static_cast<const void*>(s.data()), bytes_of(o), c.size());
  collectives::reduce_scatter(c, ptrs.data(), o.data(), o.count(), o.dtype(), op);
  o.finish();
}

AlltoallSingle::AlltoallSingle(const at::Tensor& output, const at::Tensor& input,
                               const std::vector<int64_t>& output_split_sizes,
                               const std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions&, int,
                               int size) {
  check_tensor(input, kName, "input");
  check_tensor(output, kName, "output");
  check_writable(output, kName, "output");
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "torchpar all_to_all_single: output dtype ",
              output.scalar_type(), " differs from input dtype ", input.scalar_type());
  send_counts = split_counts(input, input_split_sizes, size, "input");
  recv_counts = split_counts(output, output_split_sizes, size, "output");
  in = input;
  out = output;
}

void AlltoallSingle::run(Comm& c) const {
  Staged s = Staged::input(in);
  Staged o = Staged::output(out);
  // Complex tensors travel as pairs of reals: twice the elements.
  size_t scale = in.is_complex() ? 2 : 1;
  std::vector<size_t> sc, rc;
  std::vector<const void*> sends;
  std::vector<void*> recvs;
  size_t es = s.buffer.element_size(), soff = 0, roff = 0;
  for (int r = 0; r < c.size(); ++r) {
    sc.push_back(send_counts[r] * scale);
    rc.push_back(recv_counts[r] * scale);
    sends.push_back(static_cast<const char*>(s.data()) + soff * es);
    recvs.push_back(static_cast<char*>(o.data()) + roff * es);
    soff += sc.back();
    roff += rc.back();
  }
  collectives::alltoall(c, sends.data(), sc.data(), recvs.data(), rc.data(), s.dtype());
  o.finish();
}

Alltoall::Alltoall(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                   const c10d::AllToAllOptions&, int, int size) {
  TORCH_CHECK(static_cast<int>(inputs.size()) == size && static_cast<int>(outputs.size()) == size,
              "torchpar all_to_all: expects ", size, " input and output tensors, got ", inputs.size(), " and ",
              outputs.size());
  check_tensors(inputs, kName, "input");
  check_tensors(outputs, kName, "output");
  check_writable(outputs, kName, "output");
  for (int r = 0; r < size; ++r) {
    TORCH_CHECK(inputs[r].scalar_type() == inputs[0].scalar_type() &&
                    outputs[r].scalar_type() == inputs[0].scalar_type(),
                "torchpar all_to_all: all tensors must have one dtype");
  }
  ins = inputs;
  outs = outputs;
}

void Alltoall::run(Comm& c) const {
  std::vector<Staged> si, so;
  std::vector<const void*> sends;
  std::vector<void*> recvs;
  std::vector<size_t> sc, rc;
  for (auto& t : ins) {
    si.push_back(Staged::input(t));
    sends.push_back(si.back().data());
    sc.push_back(si.back().count());
  }
  for (auto& t : outs) {
    so.push_back(Staged::output(t));
    recvs.push_back(so.back().data());
    rc.push_back(so.back().count());
  }
  collectives::alltoall(c, sends.data(), sc.data(), recvs.data(), rc.data(), si[0].dtype());
  for (auto& o : so) o.finish();
}

void Barrier::run(Comm& c) const { collectives::barrier(c); }

}  // namespace torchpar::ops
