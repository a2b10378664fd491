// Tensor-parallel region operators and the linear with asynchronous communication; see
// tensor_parallel.h for the table of forwards and backwards.
#include "parallel/tensor_parallel.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <atomic>
#include <mutex>
#include <sstream>

// _allgather_base / _reduce_scatter_base: renamed all_gather_single / reduce_scatter_single in
// torch 2.13, the old names kept as deprecated aliases; the old names build against every
// torch the project supports (2.11 on the GPU machines has only them).
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace torchpar::parallel::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// ---- bookkeeping: bytes sent and the backward's event trace ----

std::atomic<double> g_bytes{0};
std::atomic<bool> g_tracing{false};
std::mutex g_trace_mutex;
std::vector<std::pair<std::string, std::string>> g_trace;

void record(const char* event, const std::string& what) {
  if (!g_tracing.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(g_trace_mutex);
  g_trace.emplace_back(event, what);
}

// Bytes each rank sends in a bandwidth-optimal (ring) algorithm, nccl-tests' convention:
// all-reduce 2(n-1)/n of the tensor, reduce-scatter (n-1)/n of its input, all-gather (n-1)
// input shards.
void count(const at::Tensor& t, double share) {
  g_bytes.fetch_add(share * static_cast<double>(t.numel() * t.element_size()));
}

// ---- collectives over whole tensors, through the public c10d API ----

int64_t size_of(const Group& group) { return group->getSize(); }

c10::intrusive_ptr<c10d::Work> start_all_reduce(at::Tensor& tensor, const Group& group) {
  const double n = size_of(group);
  count(tensor, 2 * (n - 1) / n);
  std::vector<at::Tensor> tensors{tensor};
  return group->allreduce(tensors);
}

// Concatenation of every rank's `input` along dim 0, into a fresh tensor.
std::pair<at::Tensor, c10::intrusive_ptr<c10d::Work>> start_all_gather_dim0(
    const at::Tensor& input, const Group& group) {
  at::Tensor in = input.contiguous();
  std::vector<int64_t> sizes = in.sizes().vec();
  sizes[0] *= size_of(group);
  at::Tensor out = at::empty(sizes, in.options());
  count(in, size_of(group) - 1);
  return {out, group->_allgather_base(out, in)};
}

// This rank's block along dim 0 of the sum over ranks of `input`.
std::pair<at::Tensor, c10::intrusive_ptr<c10d::Work>> start_reduce_scatter_dim0(
    const at::Tensor& input, const Group& group) {
  at::Tensor in = input.contiguous();
  std::vector<int64_t> sizes = in.sizes().vec();
  sizes[0] /= size_of(group);
  at::Tensor out = at::empty(sizes, in.options());
  const double n = size_of(group);
  count(in, (n - 1) / n);
  return {out, group->_reduce_scatter_base(out, in)};
}

at::Tensor all_reduce(const at::Tensor& input, const Group& group) {
  if (size_of(group) == 1) return input;
  at::Tensor t = input.contiguous().clone(at::MemoryFormat::Contiguous);
  start_all_reduce(t, group)->wait();
  return t;
}

at::Tensor all_gather_dim0(const at::Tensor& input, const Group& group) {
  if (size_of(group) == 1) return input;
  auto [out, work] = start_all_gather_dim0(input, group);
  work->wait();
  return out;
}

at::Tensor reduce_scatter_dim0(const at::Tensor& input, const Group& group) {
  if (size_of(group) == 1) return input;
  auto [out, work] = start_reduce_scatter_dim0(input, group);
  work->wait();
  return out;
}

// The last dim is split across ranks; gathering goes through dim 0 (one contiguous
// collective) and one concatenation.
at::Tensor all_gather_last(const at::Tensor& input, const Group& group) {
  const int64_t n = size_of(group);
  if (n == 1) return input;
  at::Tensor gathered = all_gather_dim0(input.dim() == 0 ? input.reshape({1}) : input, group);
  return at::cat(gathered.chunk(n, 0), -1);
}

void check_divisible(int64_t size, const Group& group, const char* op, const char* dim) {
  const int64_t n = size_of(group);
  TORCH_CHECK_VALUE(size % n == 0, "torchpar tensor parallel: ", op, " splits the ", dim,
                    " (size ", size, ") across ", n, " ranks; it must be divisible by ", n);
}

at::Tensor split_last(const at::Tensor& input, const Group& group, const char* op) {
  const int64_t n = size_of(group);
  if (n == 1) return input;
  TORCH_CHECK_VALUE(input.dim() >= 1, "torchpar tensor parallel: ", op, " needs a tensor with a dimension to split");
  check_divisible(input.size(-1), group, op, "last dimension");
  return input.chunk(n, -1)[group->getRank()].contiguous();
}

at::Tensor split_dim0(const at::Tensor& input, const Group& group, const char* op) {
  const int64_t n = size_of(group);
  if (n == 1) return input;
  TORCH_CHECK_VALUE(input.dim() >= 1, "torchpar tensor parallel: ", op, " needs a tensor with a sequence dimension");
  check_divisible(input.size(0), group, op, "sequence dimension (dim 0)");
  return input.chunk(n, 0)[group->getRank()].contiguous();
}

Group group_of(AutogradContext* ctx) { return ctx->saved_data["group"].toCustomClass<c10d::ProcessGroup>(); }

// ---- the region operators ----

struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const Group& group) {
    ctx->saved_data["group"] = group;
    return input;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    return {all_reduce(grads[0], group_of(ctx)), at::Tensor()};
  }
};

struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& input, const Group& group) {
    return all_reduce(input, group);
  }
  static tensor_list backward(AutogradContext*, tensor_list grads) { return {grads[0], at::Tensor()}; }
};

struct ScatterToRegion : torch::autograd::Function<ScatterToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const Group& group) {
    ctx->saved_data["group"] = group;
    return split_last(input, group, "scatter_to_region");
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    return {all_gather_last(grads[0], group_of(ctx)), at::Tensor()};
  }
};

struct GatherFromRegion : torch::autograd::Function<GatherFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const Group& group) {
    ctx->saved_data["group"] = group;
    return all_gather_last(input, group);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    return {split_last(grads[0], group_of(ctx), "gather_from_region (backward)"), at::Tensor()};
  }
};

struct ScatterToSequenceRegion : torch::autograd::Function<ScatterToSequenceRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const Group& group) {
    ctx->saved_data["group"] = group;
    return split_dim0(input, group, "scatter_to_sequence_region");
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    return {all_gather_dim0(grads[0], group_of(ctx)), at::Tensor()};
  }
};

struct GatherFromSequenceRegion : torch::autograd::Function<GatherFromSequenceRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const Group& group) {
    ctx->saved_data["group"] = group;
    return all_gather_dim0(input, group);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    // The gathered activation feeds a split computation: each rank's gradient of it is a
    // partial sum, reduced and scattered back to the sequence shards in one collective.
    return {reduce_scatter_dim0(grads[0], group_of(ctx)), at::Tensor()};
  }
};

struct ReduceScatterToSequenceRegion : torch::autograd::Function<ReduceScatterToSequenceRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const Group& group) {
    ctx->saved_data["group"] = group;
    if (size_of(group) > 1) check_divisible(input.size(0), group, "reduce_scatter_to_sequence_region", "sequence dimension (dim 0)");
    return reduce_scatter_dim0(input, group);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    return {all_gather_dim0(grads[0], group_of(ctx)), at::Tensor()};
  }
};

// ---- the column-parallel linear with its backward's communication overlapped ----

struct LinearWithAsyncComm : torch::autograd::Function<LinearWithAsyncComm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const Group& group,
                            bool sequence_parallel, bool overlap) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["sequence_parallel"] = sequence_parallel;
    ctx->saved_data["overlap"] = overlap;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->save_for_backward({input, weight});
    at::Tensor total = sequence_parallel ? all_gather_dim0(input, group) : input;
    return at::linear(total, weight, bias);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const Group group = group_of(ctx);
    const bool sp = ctx->saved_data["sequence_parallel"].toBool();
    const bool overlap = ctx->saved_data["overlap"].toBool();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor grad_out = grads[0].contiguous();
    const bool distributed = size_of(group) > 1;

    // Under sequence parallelism the gathered input was not kept: gather it again while the
    // input gradient's matmul runs (arXiv:2205.05198, section 4.2.2).
    at::Tensor total = input;
    c10::intrusive_ptr<c10d::Work> gather;
    if (sp && distributed) {
      std::tie(total, gather) = start_all_gather_dim0(input, group);
      record("launch", "all_gather input");
    }
    at::Tensor grad_input = grad_out.matmul(weight);
    if (gather) {
      record("wait", "all_gather input");
      gather->wait();
      record("done", "all_gather input");
    }

    // The input gradient is a partial sum on each rank (each holds some output features):
    // start its reduction, compute the weight gradient meanwhile, then wait
    // (arXiv:1909.08053's f operator, overlapped as Megatron-LM's linear does).
    c10::intrusive_ptr<c10d::Work> reduction;
    const char* what = sp ? "reduce_scatter grad_input" : "all_reduce grad_input";
    if (distributed) {
      if (sp) {
        std::tie(grad_input, reduction) = start_reduce_scatter_dim0(grad_input, group);
      } else {
        reduction = start_all_reduce(grad_input, group);
      }
      record("launch", what);
      if (!overlap) {
        record("wait", what);
        reduction->wait();
        record("done", what);
        reduction.reset();
      }
    }

    record("wgrad_begin", "");
    const int64_t out_features = weight.size(0);
    at::Tensor go = grad_out.reshape({-1, out_features});
    at::Tensor grad_weight = go.t().mm(total.reshape({-1, weight.size(1)}));
    at::Tensor grad_bias = has_bias ? go.sum(0) : at::Tensor();
    record("wgrad_end", "");

    if (reduction) {
      record("wait", what);
      reduction->wait();
      record("done", what);
    }
    return {grad_input, grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor copy_to_region(const at::Tensor& input, const Group& group) {
  return CopyToRegion::apply(input, group);
}
at::Tensor reduce_from_region(const at::Tensor& input, const Group& group) {
  return ReduceFromRegion::apply(input, group);
}
at::Tensor scatter_to_region(const at::Tensor& input, const Group& group) {
  return ScatterToRegion::apply(input, group);
}
at::Tensor gather_from_region(const at::Tensor& input, const Group& group) {
  return GatherFromRegion::apply(input, group);
}
at::Tensor scatter_to_sequence_region(const at::Tensor& input, const Group& group) {
  return ScatterToSequenceRegion::apply(input, group);
}
at::Tensor gather_from_sequence_region(const at::Tensor& input, const Group& group) {
  return GatherFromSequenceRegion::apply(input, group);
}
at::Tensor reduce_scatter_to_sequence_region(const at::Tensor& input, const Group& group) {
  return ReduceScatterToSequenceRegion::apply(input, group);
}

at::Tensor linear_with_async_comm(const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, const Group& group,
                                  bool sequence_parallel, bool overlap) {
  TORCH_CHECK_VALUE(input.dim() >= 1 && input.size(-1) == weight.size(1),
                    "torchpar tensor parallel: linear input has ", input.size(-1),
                    " features; the weight expects ", weight.size(1));
  if (sequence_parallel && size_of(group) > 1) {
    TORCH_CHECK_VALUE(input.dim() >= 2, "torchpar tensor parallel: a sequence-parallel linear needs "
                      "an input [s, b, h] (or [s, h]); got ", input.sizes());
  }
  return LinearWithAsyncComm::apply(input, weight, bias, group, sequence_parallel, overlap);
}

void check_same_sizes(const at::Tensor& input, const Group& group, const std::string& what) {
  const int64_t n = size_of(group);
  if (n == 1) return;
  constexpr int64_t kMaxDims = 8;
  std::vector<int64_t> record(kMaxDims + 1, -1);
  record[0] = input.dim();
  for (int64_t d = 0; d < std::min<int64_t>(input.dim(), kMaxDims); ++d) record[d + 1] = input.size(d);
  // On the input's device: NCCL groups take only CUDA tensors.
  at::Tensor mine = at::tensor(record, at::kLong).to(input.device());
  at::Tensor all = at::empty({n * (kMaxDims + 1)}, mine.options());
  group->_allgather_base(all, mine)->wait();  // not counted: a check, not the payload
  all = all.cpu();
  const int64_t* v = all.data_ptr<int64_t>();
  bool same = true;
  for (int64_t i = 0; i < n * (kMaxDims + 1); ++i) same = same && v[i] == v[i % (kMaxDims + 1)];
  if (same) return;
  std::ostringstream os;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t* rec = v + r * (kMaxDims + 1);
    os << (r ? ", " : "") << "rank " << r << ": [";
    for (int64_t d = 0; d < std::min(rec[0], kMaxDims); ++d) os << (d ? ", " : "") << rec[d + 1];
    os << "]";
  }
  TORCH_CHECK_VALUE(false, "torchpar tensor parallel: ", what, " has different sizes across the ",
                    n, " ranks of the tensor-parallel group (", os.str(),
                    "); every rank of the group must get the same shape (the same sequence length)");
}

double bytes_communicated() { return g_bytes.load(); }
void reset_bytes_communicated() { g_bytes = 0; }

void set_tracing(bool on) {
  std::lock_guard<std::mutex> lock(g_trace_mutex);
  g_trace.clear();
  g_tracing = on;
}

std::vector<std::pair<std::string, std::string>> trace() {
  std::lock_guard<std::mutex> lock(g_trace_mutex);
  return g_trace;
}

}  // namespace torchpar::parallel::tp
