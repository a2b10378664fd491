// Turning user tensors into the raw contiguous buffers the collectives layer works on,
// and checking them on the calling thread so bad input fails at the call site.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <string>
#include <vector>

#include "collectives/reduce_op.h"

namespace torchpar {

// A contiguous, real-typed stand-in for a user tensor: the tensor itself when it already
// is one, otherwise a copy (complex tensors are viewed as pairs of reals).
struct Staged {
  at::Tensor user;
  at::Tensor buffer;

  // For inputs: `buffer` holds the tensor's values.
  static Staged input(const at::Tensor& t);
  // For outputs: `buffer` may be uninitialised scratch that finish() copies back.
  static Staged output(const at::Tensor& t);

  void* data() const { return buffer.data_ptr(); }
  size_t count() const { return static_cast<size_t>(buffer.numel()); }
  c10::ScalarType dtype() const { return buffer.scalar_type(); }
  // Copies the result into the user's tensor if `buffer` is a copy.
  void finish() const;
};

// Writes a collective's result into a user tensor the way the transports write into a
// contiguous one: below autograd. A copy_ through autograd would refuse a leaf that requires
// grad, or an inference tensor, depending on the grad mode of whichever thread runs the op (an
// async op runs on the group's worker, which has the default modes), and fail the group.
void write_back(const at::Tensor& user, const at::Tensor& result);

// Checks device, layout and dtype; `what` names the argument in the message.
void check_tensor(const at::Tensor& t, const char* op, const std::string& what);
// For a tensor the collective writes: no two elements may share memory (an expanded tensor).
void check_writable(const at::Tensor& t, const char* op, const std::string& what);
void check_writable(const std::vector<at::Tensor>& ts, const char* op, const std::string& what);
void check_tensors(const std::vector<at::Tensor>& ts, const char* op, const std::string& what);
void check_single(const std::vector<at::Tensor>& ts, const char* op);
void check_same_type_and_size(const at::Tensor& a, const at::Tensor& b, const char* op,
                              const std::string& what);
void check_rank(int rank, int size, const char* op, const char* role);

// Maps c10d's reduce op; PREMUL_SUM becomes SUM (the caller scales the input).
collectives::ReduceOp reduce_op(const c10d::ReduceOp& op, const char* op_name, c10::ScalarType dtype);
// For PREMUL_SUM: the input multiplied by the op's factor; otherwise `t` itself.
at::Tensor premultiply(const at::Tensor& t, const c10d::ReduceOp& op);

}  // namespace torchpar
