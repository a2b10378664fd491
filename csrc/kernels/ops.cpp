// Argument checks and the dropout seed shared by the CPU and CUDA kernels (see ops.h).
#include "kernels/ops.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/Context.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <mutex>

namespace torchpar::kernels {

namespace {

bool is_float_dtype(c10::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

// A parameter (LayerNorm's weight and bias, the bias ops' bias) has input's dtype, or float32
// beside a 16-bit input: mixed-precision training keeps its parameters in float32 (as under
// torch.autocast), and the kernels compute in float32 anyway. bias_dropout_add's residual
// follows the same rule (`why` says what a float32 one is).
void check_param(const char* op, const char* name, const at::Tensor& t, const at::Tensor& input,
                 const char* why = "") {
  const auto dt = t.scalar_type(), in = input.scalar_type();
  TORCH_CHECK(dt == in || (dt == at::kFloat && at::isReducedFloatingType(in)), "torchpar.", op,
              ": ", name, " has dtype ", dt, " but input has dtype ", in, "; ", name,
              " must have input's dtype, or be float32 beside a bfloat16 or float16 input", why);
  TORCH_CHECK(t.device() == input.device(), "torchpar.", op, ": ", name, " is on ", t.device(),
              " but input is on ", input.device());
}

}  // namespace

void check_layer_norm(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                      const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(is_float_dtype(input.scalar_type()),
              "torchpar.layer_norm: input must be float32, float64, bfloat16 or float16, got ",
              input.scalar_type());
  const auto nd = static_cast<int64_t>(normalized_shape.size());
  TORCH_CHECK(nd >= 1, "torchpar.layer_norm: normalized_shape must have at least one dim");
  auto in = input.sym_sizes();
  const auto in_nd = static_cast<int64_t>(in.size());
  bool ok = in_nd >= nd;
  for (int64_t i = 0; ok && i < nd; ++i) {
    ok = in[in_nd - nd + i] == normalized_shape[i];
  }
  TORCH_CHECK(ok, "torchpar.layer_norm: normalized_shape ", normalized_shape,
              " does not match the trailing dims of input of shape ", in,
              "; expected input of shape [*, ", normalized_shape, "]");
  for (auto [name, t] : {std::pair{"weight", &weight}, std::pair{"bias", &bias}}) {
    if (!t->has_value() || !(*t)->defined()) continue;
    check_param("layer_norm", name, **t, input);
    TORCH_CHECK((*t)->sym_sizes() == normalized_shape, "torchpar.layer_norm: ", name,
                " has shape ", (*t)->sym_sizes(), " but normalized_shape is ", normalized_shape);
  }
}

void check_bias_op(const char* op, const at::Tensor& input, const at::Tensor& bias,
                   const at::Tensor* residual) {
  TORCH_CHECK(is_float_dtype(input.scalar_type()), "torchpar.", op,
              ": input must be float32, float64, bfloat16 or float16, got ", input.scalar_type());
  TORCH_CHECK(input.dim() >= 1, "torchpar.", op, ": input must have at least one dim");
  check_param(op, "bias", bias, input);
  TORCH_CHECK(bias.dim() == 1 && bias.sym_size(0) == input.sym_size(-1), "torchpar.", op,
              ": bias must have shape [", input.sym_size(-1), "] (the last dim of input), got ",
              bias.sym_sizes());
  if (residual != nullptr) {
    check_param(op, "residual", *residual, input, " (a float32 residual stream)");
    TORCH_CHECK(residual->sym_sizes() == input.sym_sizes(), "torchpar.", op,
                ": residual has shape ", residual->sym_sizes(), " but input has shape ",
                input.sym_sizes());
  }
}

GeluApprox parse_gelu_approx(std::string_view approximate) {
  if (approximate == "none") return GeluApprox::None;
  if (approximate == "tanh") return GeluApprox::Tanh;
  TORCH_CHECK(false, "torchpar.bias_gelu: approximate must be 'none' or 'tanh', got '",
              std::string(approximate), "'");
}

BiasOpInputs prepare_bias_op(const char* op, const at::Tensor& input, const at::Tensor& bias,
                             const at::Tensor* residual) {
  check_bias_op(op, input, bias, residual);
  BiasOpInputs in;
  const auto dtype = bias_op_dtype(input, residual);
  in.x = input.to(dtype).contiguous();
  in.bias = bias.to(at::toOpMathType(dtype)).contiguous();
  if (residual != nullptr) in.residual = residual->contiguous();
  in.shape = rows_cols(in.x, in.x.size(-1));
  return in;
}

at::Tensor prepare_grad(const char* op, const at::Tensor& grad_out, const at::Tensor& input) {
  TORCH_CHECK(grad_out.sizes() == input.sizes(), "torchpar.", op, " backward: grad_out has shape ",
              grad_out.sizes(), " but input has shape ", input.sizes());
  return grad_out.to(input.scalar_type()).contiguous();
}

at::Tensor param_as_acc(const std::optional<at::Tensor>& p, int64_t cols, const at::Tensor& like,
                        double fill) {
  const auto acc = at::toOpMathType(like.scalar_type());
  if (p && p->defined()) return p->reshape({cols}).to(acc).contiguous();
  return at::full({cols}, fill, like.options().dtype(acc));
}

void check_dropout_p(double p) {
  TORCH_CHECK(p >= 0.0 && p <= 1.0, "torchpar.bias_dropout_add: p must be in [0, 1], got ", p);
}

bool in_functorch_transform() {
  // functorch keeps these keys in the thread's included set while any transform is active.
  return c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
         c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerBackMode);
}

uint64_t draw_dropout_seed() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get<at::CPUGeneratorImpl>()->random64();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_outputs(const at::Tensor& x,
                                                                  int64_t normalized_ndim) {
  const auto stats = x.options().dtype(at::toOpMathType(x.scalar_type()));
  const auto stat_shape = x.sizes().slice(0, x.dim() - normalized_ndim);
  return {at::empty_like(x), at::zeros(stat_shape, stats), at::zeros(stat_shape, stats)};
}

std::vector<c10::SymInt> layer_norm_stat_shape(const at::Tensor& input, int64_t normalized_ndim) {
  auto in = input.sym_sizes();
  return std::vector<c10::SymInt>(in.begin(), in.end() - normalized_ndim);
}

}  // namespace torchpar::kernels
