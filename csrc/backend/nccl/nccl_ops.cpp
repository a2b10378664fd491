// The c10d operations on CUDA tensors: each is checked by the CPU path's record
// (backend/ops.h) on the calling thread, then enqueued as NCCL calls (collectives/nccl/) on
// the group's communication stream. Tensors are staged as in the CPU path (backend/tensors.h):
// a contiguous, real-typed stand-in where the user's tensor is not one already.
#include <c10/cuda/CUDAGuard.h>

#include "backend/nccl/nccl_backend.h"
#include "backend/ops.h"
#include "backend/tensors.h"
#include "backend/work.h"

namespace torchpar {
namespace {

using c10d::OpType;

// NCCL's type for a tensor's elements (a complex tensor travels as pairs of its real type).
ncclDataType_t nccl_type(const at::Tensor& t, const char* op) {
  auto type = nccl::data_type(t.scalar_type());
  TORCH_CHECK(type.has_value(), "torchpar ", op, ": NCCL has no type for dtype ", t.scalar_type(),
              "; CUDA tensors may be float32/64, float16, bfloat16, int8, uint8, int32, int64, bool or complex");
  return *type;
}

// c10d's reduction as NCCL's, checked on the calling thread. PREMUL_SUM becomes an NCCL
// operator made per call (ncclRedOpCreatePreMulSum) and destroyed once the call is enqueued.
class Reduction {
 public:
  Reduction(const c10d::ReduceOp& op, const at::Tensor& t, const char* name) : kind_(op.op_) {
    reduce_op(op, name, t.scalar_type());  // the CPU path's checks: complex, bool, PREMUL_SUM types
    const bool is_bool = t.scalar_type() == at::kBool;
    switch (op.op_) {
      // A bool SUM is a logical or, a PRODUCT a logical and, as on the CPU.
      case c10d::ReduceOp::SUM: base_ = is_bool ? ncclMax : ncclSum; break;
      case c10d::ReduceOp::PRODUCT: base_ = is_bool ? ncclMin : ncclProd; break;
      case c10d::ReduceOp::MIN: base_ = ncclMin; break;
      case c10d::ReduceOp::MAX: base_ = ncclMax; break;
      case c10d::ReduceOp::AVG: base_ = ncclAvg; break;
      case c10d::ReduceOp::PREMUL_SUM: {
        auto* s = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
        TORCH_CHECK(s != nullptr, "torchpar ", name, ": PREMUL_SUM without a factor");
        const auto real = c10::toRealValueType(t.scalar_type());
        // The factor in the data's (real) type: on the GPU when given as a tensor, read by
        // NCCL from there when the kernel runs; else a host value NCCL copies at the call.
        factor_ = s->tensor_factor.defined()
                      ? s->tensor_factor.to(t.device(), real).reshape({1}).contiguous()
                      : at::scalar_tensor(s->double_factor, at::TensorOptions().dtype(real));
        break;
      }
      default:
        TORCH_CHECK(false, "torchpar ", name, ": NCCL has no ", op_name(op.op_), " reduction; bitwise ",
                    "reductions are for CPU tensors only");
    }
  }

  // The device-side factor a PREMUL_SUM reads while its kernel runs (the work holds it).
  std::vector<at::Tensor> keep() const {
    return factor_.defined() && factor_.is_cuda() ? std::vector<at::Tensor>{factor_} : std::vector<at::Tensor>{};
  }

  // The operator for one call on `l`'s communicator.
  class Scoped {
   public:
    Scoped(const Reduction& r, const nccl::Launch& l, ncclDataType_t type) : l_(l), op_(r.base_) {
      if (r.kind_ != c10d::ReduceOp::PREMUL_SUM) return;
      const auto residence = r.factor_.is_cuda() ? ncclScalarDevice : ncclScalarHostImmediate;
      l_.comm.check(ncclRedOpCreatePreMulSum(&op_, r.factor_.data_ptr(), type, residence, l_.comm.get()),
                    "ncclRedOpCreatePreMulSum", l_.deadline);
      owned_ = true;
    }
    ~Scoped() {
      // NCCL allows destroying the operator as soon as the last call using it returned.
      if (owned_ && !l_.comm.aborted()) ncclRedOpDestroy(op_, l_.comm.get());
    }
    ncclRedOp_t get() const { return op_; }

   private:
    const nccl::Launch& l_;
    ncclRedOp_t op_;
    bool owned_ = false;
  };

 private:
  static const char* op_name(c10d::ReduceOp::RedOpType op) {
    switch (op) {
      case c10d::ReduceOp::BAND: return "BAND";
      case c10d::ReduceOp::BOR: return "BOR";
      case c10d::ReduceOp::BXOR: return "BXOR";
      default: return "such";
    }
  }

  c10d::ReduceOp::RedOpType kind_;
  ncclRedOp_t base_ = ncclSum;
  at::Tensor factor_;
};

// What runs after an operation's NCCL calls are launched: staged outputs copied back into
// the user's tensors. It also holds the staging buffers (`hold`) until then: inside a
// coalescing block NCCL launches at the block's end, and a buffer freed before that could be
// handed to the next operation's staging copy, which the stream runs first.
std::function<void()> finish(std::vector<Staged> outputs, std::vector<at::Tensor> hold = {}) {
  return [outputs = std::move(outputs), hold = std::move(hold)] {
    for (const auto& s : outputs) s.finish();
  };
}

// An input staged for reading, with `user` set so finish() writes the result back there
// (for the operations that work in place).
Staged in_place(const at::Tensor& t) {
  Staged s = Staged::input(t);
  s.user = t;
  return s;
}

// Row r of a flat [size, n] buffer, shaped (and typed) as the user's tensor `like`.
at::Tensor row_as(const at::Tensor& flat, int64_t r, const at::Tensor& like) {
  at::Tensor row = flat.select(0, r);
  if (like.is_complex()) row = at::view_as_complex(row.view({-1, 2}));
  return row.view(like.sizes());
}

}  // namespace

c10::intrusive_ptr<c10d::Work> NcclBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                      const c10d::BroadcastOptions& opts) {
  ops::Broadcast op(tensors, opts, getRank(), getSize());
  const auto type = nccl_type(op.t, op.kName);
  return collective(OpType::BROADCAST, op.kName, {op.t}, {op.t}, [op, type](const nccl::Launch& l) -> Then {
    Staged s = in_place(op.t);
    nccl::broadcast(l, s.data(), s.count(), type, op.root);
    return finish({s});
  });
}

c10::intrusive_ptr<c10d::Work> NcclBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::AllreduceOptions& opts) {
  ops::Allreduce op(tensors, opts, getRank(), getSize());
  const auto type = nccl_type(op.t, op.kName);
  Reduction red(opts.reduceOp, op.t, op.kName);
  return collective(OpType::ALLREDUCE, op.kName, red.keep(), {op.t}, [op, type, red](const nccl::Launch& l) -> Then {
    Staged s = in_place(op.t);
    Reduction::Scoped rop(red, l, type);
    nccl::allreduce(l, s.data(), s.data(), s.count(), type, rop.get());
    return finish({s});
  });
}

c10::intrusive_ptr<c10d::Work> NcclBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                const c10d::AllreduceCoalescedOptions& opts) {
  ops::AllreduceCoalesced op(tensors, opts, getRank(), getSize());
  const auto type = nccl_type(op.ts[0], op.kName);
  Reduction red(opts.reduceOp, op.ts[0], op.kName);
  return collective(OpType::COALESCED, op.kName, red.keep(), op.ts, [op, type, red](const nccl::Launch& l) -> Then {
    std::vector<Staged> staged;
    Reduction::Scoped rop(red, l, type);
    nccl::Group group(l);
    for (const auto& t : op.ts) {
      staged.push_back(in_place(t));
      nccl::allreduce(l, staged.back().data(), staged.back().data(), staged.back().count(), type, rop.get());
    }
    return finish(std::move(staged));
  });
}

c10::intrusive_ptr<c10d::Work> NcclBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  ops::Reduce op(tensors, opts, getRank(), getSize());
  const auto type = nccl_type(op.t, op.kName);
  Reduction red(opts.reduceOp, op.t, op.kName);
  return collective(OpType::REDUCE, op.kName, red.keep(), {op.t}, [op, type, red](const nccl::Launch& l) -> Then {
    Staged s = in_place(op.t);
    Reduction::Scoped rop(red, l, type);
    nccl::reduce(l, s.data(), s.data(), s.count(), type, rop.get(), op.root);
    return l.comm.rank() == op.root ? finish({s}) : finish({}, {s.buffer});
  });
}

c10::intrusive_ptr<c10d::Work> NcclBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllgatherOptions& opts) {
  ops::Allgather op(outputs, inputs, opts, getRank(), getSize());
  const auto type = nccl_type(op.in, op.kName);
  return collective(OpType::ALLGATHER, op.kName, {op.in}, op.outs, [op, type](const nccl::Launch& l) -> Then {
    Staged s = Staged::input(op.in);
    // NCCL gathers into one buffer; the rows go to the user's tensors after.
    at::Tensor flat = at::empty({l.comm.size(), static_cast<int64_t>(s.count())}, s.buffer.options());
    nccl::allgather(l, s.data(), flat.data_ptr(), s.count(), type);
    return [op, flat, in = s.buffer] {
      for (size_t r = 0; r < op.outs.size(); ++r) op.outs[r].copy_(row_as(flat, r, op.outs[r]));
    };
  });
}

c10::intrusive_ptr<c10d::Work> NcclBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                            const c10d::AllgatherOptions& opts) {
  ops::AllgatherIntoTensor op(output, input, opts, getRank(), getSize());
  const auto type = nccl_type(op.in, op.kName);
  return collective(OpType::_ALLGATHER_BASE, op.kName, {op.in}, {op.out}, [op, type](const nccl::Launch& l) -> Then {
    Staged s = Staged::input(op.in);
    Staged o = Staged::output(op.out);
    nccl::allgather(l, s.data(), o.data(), s.count(), type);
    return finish({o}, {s.buffer});
  });
}

c10::intrusive_ptr<c10d::Work> NcclBackend::as_one_block(const std::function<void()>& issue) {
  if (coalescing_) {  // inside the caller's block: its end launches these too
    issue();
    if (pending_.empty()) return GroupWork::create(getRank(), {});
    return pending_.back().work;
  }
  startCoalescing();
  issue();  // each operation was checked before any was issued: nothing throws half-way
  return endCoalescing();
}

c10::intrusive_ptr<c10d::Work> NcclBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                std::vector<at::Tensor>& inputs,
                                                                const c10d::AllgatherOptions& opts) {
  // torch's layout: outputs[r][i] receives rank r's inputs[i]. Checked whole, then one
  // all-gather per input in one NCCL group.
  TORCH_CHECK(static_cast<int>(outputs.size()) == getSize(), "torchpar all_gather_coalesced: ", outputs.size(),
              " output lists for a group of size ", getSize());
  std::vector<std::vector<std::vector<at::Tensor>>> per_input(inputs.size(), {{}});
  for (size_t i = 0; i < inputs.size(); ++i) {
    for (size_t r = 0; r < outputs.size(); ++r) {
      TORCH_CHECK(outputs[r].size() == inputs.size(), "torchpar all_gather_coalesced: output list ", r, " has ",
                  outputs[r].size(), " tensors for ", inputs.size(), " inputs");
      per_input[i][0].push_back(outputs[r][i]);
    }
    std::vector<at::Tensor> in{inputs[i]};
    ops::Allgather check(per_input[i], in, opts, getRank(), getSize());
    nccl_type(inputs[i], "all_gather_coalesced");
  }
  return as_one_block([&] {
    for (size_t i = 0; i < inputs.size(); ++i) {
      std::vector<at::Tensor> in{inputs[i]};
      allgather(per_input[i], in, opts);
    }
  });
}

c10::intrusive_ptr<c10d::Work> NcclBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                            std::vector<at::Tensor>& inputs,
                                                                            const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "torchpar all_gather_into_tensor_coalesced: ", outputs.size(),
              " outputs for ", inputs.size(), " inputs");
  for (size_t i = 0; i < inputs.size(); ++i) {
    ops::AllgatherIntoTensor check(outputs[i], inputs[i], opts, getRank(), getSize());
    nccl_type(inputs[i], check.kName);
  }
  return as_one_block([&] {
    for (size_t i = 0; i < inputs.size(); ++i) _allgather_base(outputs[i], inputs[i], opts);
  });
}

c10::intrusive_ptr<c10d::Work> NcclBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                   std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  ops::Gather op(outputs, inputs, opts, getRank(), getSize());
  const auto type = nccl_type(op.in, op.kName);
  return collective(OpType::GATHER, op.kName, {op.in}, op.outs, [op, type](const nccl::Launch& l) -> Then {
    Staged s = Staged::input(op.in);
    std::vector<Staged> outs;
    std::vector<void*> ptrs;
    for (const auto& o : op.outs) {
      outs.push_back(Staged::output(o));
      ptrs.push_back(outs.back().data());
    }
    nccl::gather(l, s.data(), ptrs, s.count(), type, op.root);
    return finish(std::move(outs), {s.buffer});
  });
}

c10::intrusive_ptr<c10d::Work> NcclBackend::scatter(std::vector<at::Tensor>& outputs,
                                                    std::vector<std::vector<at::Tensor>>& inputs,
                                                    const c10d::ScatterOptions& opts) {
  ops::Scatter op(outputs, inputs, opts, getRank(), getSize());
  const auto type = nccl_type(op.out, op.kName);
  return collective(OpType::SCATTER, op.kName, op.ins, {op.out}, [op, type](const nccl::Launch& l) -> Then {
    Staged o = Staged::output(op.out);
    std::vector<at::Tensor> ins;
    std::vector<const void*> ptrs;
    for (const auto& i : op.ins) {
      ins.push_back(Staged::input(i).buffer);
      ptrs.push_back(ins.back().data_ptr());
    }
    nccl::scatter(l, ptrs, o.data(), o.count(), type, op.root);
    return finish({o}, std::move(ins));
  });
}

c10::intrusive_ptr<c10d::Work> NcclBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                           std::vector<std::vector<at::Tensor>>& inputs,
                                                           const c10d::ReduceScatterOptions& opts) {
  ops::ReduceScatter op(outputs, inputs, opts, getRank(), getSize());
  const auto type = nccl_type(op.out, op.kName);
  Reduction red(opts.reduceOp, op.out, op.kName);
  auto held = op.ins;
  for (auto& k : red.keep()) held.push_back(k);
  return collective(OpType::REDUCE_SCATTER, op.kName, held, {op.out}, [op, type, red](const nccl::Launch& l) -> Then {
    // NCCL reduces one buffer of size() blocks: the inputs laid end to end.
    std::vector<at::Tensor> flat;
    for (const auto& i : op.ins) flat.push_back(Staged::input(i).buffer.reshape({-1}));
    at::Tensor in = at::cat(flat);
    Staged o = Staged::output(op.out);
    Reduction::Scoped rop(red, l, type);
    nccl::reduce_scatter(l, in.data_ptr(), o.data(), o.count(), type, rop.get());
    return finish({o}, {in});
  });
}

c10::intrusive_ptr<c10d::Work> NcclBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::ReduceScatterOptions& opts) {
  ops::ReduceScatterTensor op(output, input, opts, getRank(), getSize());
  const auto type = nccl_type(op.out, op.kName);
  Reduction red(opts.reduceOp, op.out, op.kName);
  auto held = red.keep();
  held.push_back(op.in);
  return collective(OpType::_REDUCE_SCATTER_BASE, op.kName, held, {op.out},
                    [op, type, red](const nccl::Launch& l) -> Then {
                      Staged s = Staged::input(op.in);
                      Staged o = Staged::output(op.out);
                      Reduction::Scoped rop(red, l, type);
                      nccl::reduce_scatter(l, s.data(), o.data(), o.count(), type, rop.get());
                      return finish({o}, {s.buffer});
                    });
}

c10::intrusive_ptr<c10d::Work> NcclBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                            std::vector<at::Tensor>& inputs,
                                                                            const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "torchpar reduce_scatter_tensor_coalesced: ", outputs.size(),
              " outputs for ", inputs.size(), " inputs");
  for (size_t i = 0; i < inputs.size(); ++i) {
    ops::ReduceScatterTensor check(outputs[i], inputs[i], opts, getRank(), getSize());
    nccl_type(inputs[i], check.kName);
    (void)Reduction(opts.reduceOp, outputs[i], check.kName);
  }
  return as_one_block([&] {
    for (size_t i = 0; i < inputs.size(); ++i) _reduce_scatter_base(outputs[i], inputs[i], opts);
  });
}

c10::intrusive_ptr<c10d::Work> NcclBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                          std::vector<int64_t>& output_split_sizes,
                                                          std::vector<int64_t>& input_split_sizes,
                                                          const c10d::AllToAllOptions& opts) {
  ops::AlltoallSingle op(output, input, output_split_sizes, input_split_sizes, opts, getRank(), getSize());
  const auto type = nccl_type(op.in, op.kName);
  return collective(OpType::ALLTOALL_BASE, op.kName, {op.in}, {op.out}, [op, type](const nccl::Launch& l) -> Then {
    Staged s = Staged::input(op.in);
    Staged o = Staged::output(op.out);
    const size_t scale = op.in.is_complex() ? 2 : 1;  // complex elements travel as two reals
    const size_t es = s.buffer.element_size();
    std::vector<const void*> sends;
    std::vector<void*> recvs;
    std::vector<size_t> sc, rc;
    size_t soff = 0, roff = 0;
    for (int r = 0; r < l.comm.size(); ++r) {
      sc.push_back(op.send_counts[r] * scale);
      rc.push_back(op.recv_counts[r] * scale);
      sends.push_back(static_cast<const char*>(s.data()) + soff * es);
      recvs.push_back(static_cast<char*>(o.data()) + roff * es);
      soff += sc.back();
      roff += rc.back();
    }
    nccl::alltoall(l, sends, sc, recvs, rc, type);
    return finish({o}, {s.buffer});
  });
}

c10::intrusive_ptr<c10d::Work> NcclBackend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                     const c10d::AllToAllOptions& opts) {
  ops::Alltoall op(outputs, inputs, opts, getRank(), getSize());
  const auto type = nccl_type(op.ins[0], op.kName);
  return collective(OpType::ALLTOALL, op.kName, op.ins, op.outs, [op, type](const nccl::Launch& l) -> Then {
    std::vector<Staged> outs;
    std::vector<at::Tensor> ins;
    std::vector<const void*> sends;
    std::vector<void*> recvs;
    std::vector<size_t> sc, rc;
    for (const auto& t : op.ins) {
      ins.push_back(Staged::input(t).buffer);
      sends.push_back(ins.back().data_ptr());
      sc.push_back(static_cast<size_t>(ins.back().numel()));
    }
    for (const auto& t : op.outs) {
      outs.push_back(Staged::output(t));
      recvs.push_back(outs.back().data());
      rc.push_back(outs.back().count());
    }
    nccl::alltoall(l, sends, sc, recvs, rc, type);
    return finish(std::move(outs), std::move(ins));
  });
}

c10::intrusive_ptr<c10d::Work> NcclBackend::point_to_point(bool is_send, at::Tensor& tensor, int peer) {
  const char* name = is_send ? "send" : "recv";
  check_tensor(tensor, name, "tensor");
  check_rank(peer, getSize(), name, is_send ? "destination" : "source");
  TORCH_CHECK(peer != getRank(), "torchpar ", name, ": rank ", getRank(), " cannot ", name,
              is_send ? " to" : " from", " itself");
  const auto type = nccl_type(tensor, name);
  at::Device device = device_of({tensor}, name);
  // Inside a coalescing block (batch_isend_irecv) the group's communicator carries the
  // batch, as one NCCL group; a lone transfer has its direction's two-rank communicator, so
  // that the other ranks need not take part in making it (where the sender is rank 0).
  Channel& channel = coalescing_ ? group_channel(device)
                                 : (is_send ? p2p_channel(device, getRank(), peer) : p2p_channel(device, peer, getRank()));
  const int comm_peer = coalescing_ ? peer : (is_send ? 1 : 0);
  at::Tensor t = tensor;
  auto body = [t, is_send, comm_peer, type](const nccl::Launch& l) -> Then {
    if (is_send) {
      Staged s = Staged::input(t);
      nccl::send(l, s.data(), s.count(), type, comm_peer);
      return finish({}, {s.buffer});
    }
    Staged s = Staged::output(t);
    nccl::recv(l, s.data(), s.count(), type, comm_peer);
    return finish({s});
  };
  return launch(channel, device, is_send ? OpType::SEND : OpType::RECV, is_send ? "send" : "recv",
                is_send ? std::vector<at::Tensor>{t} : std::vector<at::Tensor>{},
                is_send ? std::vector<at::Tensor>{} : std::vector<at::Tensor>{t}, body);
}

c10::intrusive_ptr<c10d::Work> NcclBackend::send(std::vector<at::Tensor>& tensors, int dst_rank, int) {
  check_single(tensors, "send");
  return point_to_point(true, tensors[0], dst_rank);
}

c10::intrusive_ptr<c10d::Work> NcclBackend::recv(std::vector<at::Tensor>& tensors, int src_rank, int) {
  check_single(tensors, "recv");
  return point_to_point(false, tensors[0], src_rank);
}

}  // namespace torchpar
