// Host-side pieces the CPU and CUDA kernels of the fused ops share: argument checks (run
// before any kernel, naming the bad argument), the dropout seed, and the views the
// kernels work on. The math itself lives in philox.h, dropout.h, gelu.h, welford.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/OptionalArrayRef.h>

#include <array>
#include <cstdint>
#include <optional>
#include <vector>
#include <string_view>
#include <type_traits>

#include "kernels/gelu.h"

namespace torchpar::kernels {

// Kernels see every op's input as a contiguous [rows, cols] matrix.
struct RowsCols {
  int64_t rows = 0;
  int64_t cols = 0;
};
inline RowsCols rows_cols(const at::Tensor& t, int64_t cols) {
  return RowsCols{cols == 0 ? 0 : t.numel() / cols, cols};
}

// The checks read symbolic sizes so that the Meta kernels (torch.compile tracing) run
// them too; on real tensors they are plain integers.

// Mixed precision: a parameter (LayerNorm's weight and bias, the bias ops' bias) has input's
// dtype, or float32 beside a bfloat16 or float16 input; outputs keep input's dtype and each
// parameter's gradient has the parameter's dtype (summed in float32, never rounded to 16 bits).
// bias_dropout_add's residual may likewise be float32 beside a 16-bit input (a float32 residual
// stream): then input is promoted and the output is float32, as the unfused composite's is.

// layer_norm: normalized_shape matches the trailing dims of input; weight and bias, when
// given, have shape normalized_shape, a parameter dtype (above) and input's device.
void check_layer_norm(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                      const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias);

// bias_gelu / bias_dropout_add: bias is 1-D of size input.size(-1); residual (when given)
// has input's shape; dtypes as above, one device. `op` names the caller in errors.
void check_bias_op(const char* op, const at::Tensor& input, const at::Tensor& bias,
                   const at::Tensor* residual);

GeluApprox parse_gelu_approx(std::string_view approximate);

// What every bias_gelu / bias_dropout_add kernel reads: input (and residual) contiguous,
// the bias in the accumulate type (kernels read it once per row; converting it once here
// beats converting it per row), and the [rows, cols] view. Runs check_bias_op first.
struct BiasOpInputs {
  at::Tensor x;         // in the output's dtype: promoted to a float32 residual's
  at::Tensor bias;      // accumulate type, contiguous
  at::Tensor residual;  // contiguous; undefined when the op has none
  RowsCols shape;
};
BiasOpInputs prepare_bias_op(const char* op, const at::Tensor& input, const at::Tensor& bias,
                             const at::Tensor* residual);

// bias_dropout_add's output dtype: input's, or float32 with a float32 residual (above).
inline c10::ScalarType bias_op_dtype(const at::Tensor& input, const at::Tensor* residual) {
  return residual != nullptr ? residual->scalar_type() : input.scalar_type();
}

// grad_out as a contiguous tensor of input's dtype, after checking it has input's shape.
at::Tensor prepare_grad(const char* op, const at::Tensor& grad_out, const at::Tensor& input);

// LayerNorm's weight or bias as a contiguous accumulate-type vector on `like`'s device;
// `fill` (1 or 0) where it is absent, so the kernels have a single code path.
at::Tensor param_as_acc(const std::optional<at::Tensor>& p, int64_t cols, const at::Tensor& like,
                        double fill);

// Turn run-time choices into template arguments, so per-element loops carry no branch.
template <typename F>
void with_gelu_approx(GeluApprox approx, F&& f) {
  if (approx == GeluApprox::Tanh) {
    f(std::integral_constant<GeluApprox, GeluApprox::Tanh>{});
  } else {
    f(std::integral_constant<GeluApprox, GeluApprox::None>{});
  }
}

template <typename F>
void with_flag(bool flag, F&& f) {
  if (flag) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// Whether `t` carries a forward-mode tangent (torch.autograd.forward_ad).
inline bool has_tangent(const at::Tensor& t) {
  return t.defined() && t._fw_grad(/*level=*/0).defined();
}
inline bool has_tangent(const std::optional<at::Tensor>& t) { return t && has_tangent(*t); }

// Whether a functorch transform (torch.func.grad, vjp, jvp, vmap, ...) is active.
bool in_functorch_transform();

// Whether an op must run as ATen's composite of its math rather than its fused kernels: a C++
// autograd function has no jvp, and torch refuses to run one under a functorch transform.
// The composite's ops support both, and keep their backward formulas.
template <typename... Ts>
bool needs_composite(const Ts&... inputs) {
  return in_functorch_transform() || (has_tangent(inputs) || ...);
}

// dropout probability in [0, 1].
void check_dropout_p(double p);

// A fresh 64-bit Philox key from torch's default CPU generator, for every device: after
// torch.manual_seed(s) a CPU and a CUDA call draw the same key, hence the same mask.
uint64_t draw_dropout_seed();

// layer_norm_fwd's outputs for a contiguous input: y like x, and mean and rstd of x's
// leading shape in the accumulate type (zero-filled, so an empty row has defined stats).
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_outputs(const at::Tensor& x,
                                                                  int64_t normalized_ndim);

// Which gradients a layer_norm backward produces: output_mask is (input, weight, bias), as in
// torch's native_layer_norm_backward, and a parameter's gradient needs the parameter. The
// others come back as empty tensors, and no pass over the data is made for them (frozen
// parameters, as in adapter or LoRA fine-tuning, or a LayerNorm on a frozen input).
struct LayerNormGrads {
  bool dx, dweight, dbias;
  LayerNormGrads(std::array<bool, 3> output_mask, const std::optional<at::Tensor>& weight,
                 const std::optional<at::Tensor>& bias)
      : dx(output_mask[0]),
        dweight(output_mask[1] && weight && weight->defined()),
        dbias(output_mask[2] && bias && bias->defined()) {}
  bool params() const { return dweight || dbias; }
  std::array<bool, 3> mask() const { return {dx, dweight, dbias}; }
};

// Shape of LayerNorm's saved mean/rstd: input's leading dims (those not normalised).
std::vector<c10::SymInt> layer_norm_stat_shape(const at::Tensor& input, int64_t normalized_ndim);

}  // namespace torchpar::kernels
