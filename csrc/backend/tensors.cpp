#include "backend/tensors.h"

#include <ATen/MemoryOverlap.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace torchpar {

namespace {

at::Tensor as_real(const at::Tensor& t) { return t.is_complex() ? at::view_as_real(t) : t; }

bool supported_dtype(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16:
    case at::kChar: case at::kByte: case at::kShort: case at::kInt: case at::kLong: case at::kBool:
    case at::kComplexFloat: case at::kComplexDouble:
      return true;
    default:
      return false;
  }
}

}  // namespace

Staged Staged::input(const at::Tensor& t) {
  // Conjugate and negative views are lazy: materialise them before reading raw memory.
  return Staged{t, as_real(t.resolve_conj().resolve_neg().contiguous())};
}

Staged Staged::output(const at::Tensor& t) {
  if (t.is_contiguous() && !t.is_conj() && !t.is_neg()) return Staged{t, as_real(t)};
  return Staged{t, as_real(at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous)))};
}

void Staged::finish() const {
  if (buffer.data_ptr() == user.data_ptr()) return;  // the collective worked in place
  write_back(user, user.is_complex() ? at::view_as_complex(buffer) : buffer);
}

void write_back(const at::Tensor& user, const at::Tensor& result) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  user.copy_(result);
}

void check_writable(const at::Tensor& t, const char* op, const std::string& what) {
  TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, "torchpar ", op, ": ", what,
              " is written to, but several of its elements share memory (an expanded tensor?); pass a tensor "
              "whose elements each have their own memory (e.g. .contiguous())");
}

void check_writable(const std::vector<at::Tensor>& ts, const char* op, const std::string& what) {
  for (size_t i = 0; i < ts.size(); ++i) check_writable(ts[i], op, what + "[" + std::to_string(i) + "]");
}

void check_tensor(const at::Tensor& t, const char* op, const std::string& what) {
  TORCH_CHECK(t.defined(), "torchpar ", op, ": ", what, " is an undefined tensor");
  // Which device carries the call is decided before (backend/cuda.h's on_cuda).
  TORCH_CHECK(t.is_cpu() || t.is_cuda(), "torchpar ", op, ": ", what, " is on ", t.device(),
              "; torchpar moves CPU and CUDA tensors");
  TORCH_CHECK(t.layout() == at::kStrided, "torchpar ", op, ": ", what,
              " must be a dense (strided) tensor, got layout ", t.layout());
  TORCH_CHECK(supported_dtype(t.scalar_type()), "torchpar ", op, ": ", what, " has dtype ",
              t.scalar_type(), ", which torchpar does not support");
}

void check_tensors(const std::vector<at::Tensor>& ts, const char* op, const std::string& what) {
  for (size_t i = 0; i < ts.size(); ++i) check_tensor(ts[i], op, what + "[" + std::to_string(i) + "]");
}

void check_single(const std::vector<at::Tensor>& ts, const char* op) {
  TORCH_CHECK(ts.size() == 1, "torchpar ", op, ": expects exactly one tensor per call, got ", ts.size());
  check_tensor(ts[0], op, "tensor");
}

void check_same_type_and_size(const at::Tensor& a, const at::Tensor& b, const char* op,
                              const std::string& what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "torchpar ", op, ": ", what, " has dtype ",
              b.scalar_type(), " but the input has dtype ", a.scalar_type());
  TORCH_CHECK(a.numel() == b.numel(), "torchpar ", op, ": ", what, " has ", b.numel(),
              " elements but the input has ", a.numel());
}

void check_rank(int rank, int size, const char* op, const char* role) {
  TORCH_CHECK(rank >= 0 && rank < size, "torchpar ", op, ": invalid ", role, " rank ", rank,
              " for a group of size ", size);
}

collectives::ReduceOp reduce_op(const c10d::ReduceOp& op, const char* op_name, c10::ScalarType dtype) {
  using collectives::ReduceOp;
  ReduceOp out;
  switch (op.op_) {
    case c10d::ReduceOp::SUM: out = ReduceOp::kSum; break;
    case c10d::ReduceOp::AVG: out = ReduceOp::kAvg; break;
    case c10d::ReduceOp::PRODUCT: out = ReduceOp::kProduct; break;
    case c10d::ReduceOp::MIN: out = ReduceOp::kMin; break;
    case c10d::ReduceOp::MAX: out = ReduceOp::kMax; break;
    case c10d::ReduceOp::BAND: out = ReduceOp::kBand; break;
    case c10d::ReduceOp::BOR: out = ReduceOp::kBor; break;
    case c10d::ReduceOp::BXOR: out = ReduceOp::kBxor; break;
    case c10d::ReduceOp::PREMUL_SUM: out = ReduceOp::kSum; break;
    default: TORCH_CHECK(false, "torchpar ", op_name, ": unsupported reduce op ", static_cast<int>(op.op_));
  }
  bool complex = c10::isComplexType(dtype);
  TORCH_CHECK(!complex || out == ReduceOp::kSum || out == ReduceOp::kAvg, "torchpar ", op_name,
              ": complex tensors support only SUM, AVG and PREMUL_SUM");
  TORCH_CHECK(!(c10::isFloatingType(dtype) || complex) ||
                  (out != ReduceOp::kBand && out != ReduceOp::kBor && out != ReduceOp::kBxor),
              "torchpar ", op_name, ": bitwise reduce ops are not defined for dtype ", dtype);
  TORCH_CHECK(!(op.op_ == c10d::ReduceOp::PREMUL_SUM && !(c10::isFloatingType(dtype) || complex)),
              "torchpar ", op_name, ": PREMUL_SUM needs a floating-point tensor, got ", dtype);
  TORCH_CHECK(!(out == ReduceOp::kAvg && dtype == at::kBool), "torchpar ", op_name,
              ": AVG is not defined for bool");
  return out;
}

at::Tensor premultiply(const at::Tensor& t, const c10d::ReduceOp& op) {
  if (op.op_ != c10d::ReduceOp::PREMUL_SUM) return t;
  // The name torch 2.11 declares; newer torch renamed it PreMulSumSupplement and keeps this alias.
  auto* s = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK(s != nullptr, "torchpar: PREMUL_SUM without a factor");
  if (s->tensor_factor.defined()) return t * s->tensor_factor.to(t.device());
  return t * s->double_factor;
}

}  // namespace torchpar
