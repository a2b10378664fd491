// torchpar::layer_norm: schema, autograd and Meta kernel. CPU and CUDA kernels of
// layer_norm_fwd / layer_norm_bwd live in cpu/layer_norm.cpp and cuda/layer_norm.cu.
//
// layer_norm is the public op. Its Autograd kernel saves the input with the mean and rstd
// that layer_norm_fwd returns (float32, or float64 for float64 input), so the backward
// never recomputes statistics; its CompositeExplicitAutograd kernel serves inference.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/native_layer_norm_backward.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <numeric>
#include <vector>

#include "kernels/ops.h"

namespace torchpar::kernels {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

std::tuple<Tensor, Tensor, Tensor> layer_norm_fwd(const Tensor& input, c10::SymIntArrayRef shape,
                                                  const OptTensor& weight, const OptTensor& bias,
                                                  double eps) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchpar::layer_norm_fwd", "")
                       .typed<std::tuple<Tensor, Tensor, Tensor>(
                           const Tensor&, c10::SymIntArrayRef, const OptTensor&,
                           const OptTensor&, double)>();
  return op.call(input, shape, weight, bias, eps);
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_bwd(const Tensor& grad_out, const Tensor& input,
                                                  c10::SymIntArrayRef shape, const Tensor& mean,
                                                  const Tensor& rstd, const OptTensor& weight,
                                                  const OptTensor& bias,
                                                  std::array<bool, 3> output_mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchpar::layer_norm_bwd", "")
                       .typed<std::tuple<Tensor, Tensor, Tensor>(
                           const Tensor&, const Tensor&, c10::SymIntArrayRef, const Tensor&,
                           const Tensor&, const OptTensor&, const OptTensor&, std::array<bool, 3>)>();
  return op.call(grad_out, input, shape, mean, rstd, weight, bias, output_mask);
}

class LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
  // create_graph: the gradients must themselves be differentiable. torch's
  // native_layer_norm_backward has a derivative of its own (the dependence of mean and rstd on
  // the input included). It wants statistics shaped [*leading, 1, ...] in the input's dtype,
  // so it runs in the statistics' dtype (float32 for reduced types, as our kernels compute).
  static torch::autograd::variable_list differentiable_backward(const Tensor& grad,
                                                                const std::vector<Tensor>& saved,
                                                                c10::SymIntArrayRef shape,
                                                                const LayerNormGrads& want) {
    const Tensor &input = saved[0], &mean = saved[1], &rstd = saved[2];
    const auto acc = mean.scalar_type();
    auto up = [&](const Tensor& t) { return t.defined() ? OptTensor(t.to(acc)) : std::nullopt; };
    std::vector<c10::SymInt> stat_shape(mean.sym_sizes().begin(), mean.sym_sizes().end());
    stat_shape.resize(stat_shape.size() + shape.size(), 1);
    const Tensor g = grad.to(acc);
    auto [dx, dw, unused] = at::native_layer_norm_backward_symint(
        g, input.to(acc), shape, mean.view_symint(stat_shape), rstd.view_symint(stat_shape),
        up(saved[3]), up(saved[4]), {want.dx, want.dweight, false});
    // dbias is grad summed over the leading dims, taken here: native_layer_norm_backward's own
    // has no second derivative when there is no weight.
    Tensor db;
    if (want.dbias) {
      std::vector<int64_t> leading(grad.dim() - static_cast<int64_t>(shape.size()));
      std::iota(leading.begin(), leading.end(), 0);
      db = leading.empty() ? g : g.sum(leading);
    }
    auto down = [](bool wanted, const Tensor& g, const Tensor& like) {
      return wanted ? g.to(like.scalar_type()) : Tensor();
    };
    return {down(want.dx, dx, input), Tensor(), down(want.dweight, dw, saved[3]),
            down(want.dbias, db, saved[4]), Tensor()};
  }

 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& input,
                        c10::SymIntArrayRef shape, const OptTensor& weight,
                        const OptTensor& bias, double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, mean, rstd] = layer_norm_fwd(input, shape, weight, bias, eps);
    ctx->save_for_backward({input, mean, rstd, weight.value_or(Tensor()),
                            bias.value_or(Tensor())});
    ctx->saved_data["shape"] = c10::IValue(std::vector<c10::SymInt>(shape.begin(), shape.end()));
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto shape = ctx->saved_data["shape"].toSymIntVector();
    OptTensor weight = saved[3].defined() ? OptTensor(saved[3]) : std::nullopt;
    OptTensor bias = saved[4].defined() ? OptTensor(saved[4]) : std::nullopt;
    // Autograd's edges follow the tensors given: input, then weight and bias where present.
    const size_t bias_edge = weight ? 2 : 1;
    const LayerNormGrads want({ctx->needs_input_grad(0), weight && ctx->needs_input_grad(1),
                               bias && ctx->needs_input_grad(bias_edge)},
                              weight, bias);
    if (at::GradMode::is_enabled()) return differentiable_backward(grads[0], saved, shape, want);
    auto [dx, dw, db] = layer_norm_bwd(grads[0], saved[0], shape, saved[1], saved[2], weight, bias,
                                       want.mask());
    return {want.dx ? dx : Tensor(), Tensor(), want.dweight ? dw : Tensor(),
            want.dbias ? db : Tensor(), Tensor()};
  }
};

// torch's layer_norm, for forward-mode AD and functorch transforms (see needs_composite).
Tensor layer_norm_unfused(const Tensor& input, c10::SymIntArrayRef shape, const OptTensor& weight,
                          const OptTensor& bias, double eps) {
  check_layer_norm(input, shape, weight, bias);
  const auto dt = input.scalar_type();
  auto given = [](const OptTensor& p) { return p && p->defined(); };
  const bool mixed = (given(weight) && weight->scalar_type() != dt) ||
                     (given(bias) && bias->scalar_type() != dt);
  if (!mixed) return at::layer_norm_symint(input, shape, weight, bias, eps);
  // A float32 parameter beside 16-bit input (kernels/ops.h), the other one either dtype: all in
  // float32, as the kernels compute.
  auto as_float = [&](const OptTensor& p) { return given(p) ? OptTensor(p->to(at::kFloat)) : p; };
  return at::layer_norm_symint(input.to(at::kFloat), shape, as_float(weight), as_float(bias), eps)
      .to(dt);
}

Tensor layer_norm_autograd(const Tensor& input, c10::SymIntArrayRef shape, const OptTensor& weight,
                           const OptTensor& bias, double eps) {
  if (needs_composite(input, weight, bias)) return layer_norm_unfused(input, shape, weight, bias, eps);
  return LayerNormFunction::apply(input, shape, weight, bias, eps);
}

Tensor layer_norm_composite(const Tensor& input, c10::SymIntArrayRef shape,
                            const OptTensor& weight, const OptTensor& bias, double eps) {
  return std::get<0>(layer_norm_fwd(input, shape, weight, bias, eps));
}

// Meta: shapes and dtypes only, so torch.compile traces through without a graph break.
std::tuple<Tensor, Tensor, Tensor> layer_norm_fwd_meta(const Tensor& input,
                                                       c10::SymIntArrayRef shape,
                                                       const OptTensor& weight,
                                                       const OptTensor& bias, double eps) {
  check_layer_norm(input, shape, weight, bias);
  auto stat_type = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto stat_shape = layer_norm_stat_shape(input, static_cast<int64_t>(shape.size()));
  return {at::empty_symint(input.sym_sizes(), input.options()),
          at::empty_symint(stat_shape, input.options().dtype(stat_type)),
          at::empty_symint(stat_shape, input.options().dtype(stat_type))};
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_bwd_meta(const Tensor& grad_out, const Tensor& input,
                                                       c10::SymIntArrayRef shape,
                                                       const Tensor& mean, const Tensor& rstd,
                                                       const OptTensor& weight,
                                                       const OptTensor& bias,
                                                       std::array<bool, 3> output_mask) {
  const LayerNormGrads want(output_mask, weight, bias);
  auto grad = [&](bool wanted, const Tensor& like) {
    return wanted ? at::empty_symint(like.sym_sizes(), like.options())
                  : at::empty({0}, input.options());
  };
  return {grad(want.dx, input), grad(want.dweight, want.dweight ? *weight : input),
          grad(want.dbias, want.dbias ? *bias : input)};
}

}  // namespace

// FRAGMENT: other layers of torchpar register their own ops in the same namespace.
TORCH_LIBRARY_FRAGMENT(torchpar, m) {
  m.def("layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, "
        "Tensor? bias=None, float eps=1e-05) -> Tensor");
  // Returns (output, mean, rstd); mean and rstd have input's leading shape.
  m.def("layer_norm_fwd(Tensor input, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, "
        "float eps) -> (Tensor, Tensor, Tensor)");
  // Returns (grad_input, grad_weight, grad_bias): those output_mask asks for (a parameter's
  // only when it is given), the others empty, never computed (kernels/ops.h, LayerNormGrads).
  // New arguments take defaults that keep the old behaviour: graphs that torch.compile cached
  // before they existed call the op without them.
  m.def("layer_norm_bwd(Tensor grad_out, Tensor input, SymInt[] normalized_shape, Tensor mean, "
        "Tensor rstd, Tensor? weight, Tensor? bias, bool[3] output_mask=[True, True, True]) "
        "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(torchpar, Autograd, m) {
  m.impl("layer_norm", &layer_norm_autograd);
}

TORCH_LIBRARY_IMPL(torchpar, CompositeExplicitAutograd, m) {
  m.impl("layer_norm", &layer_norm_composite);
}

// Under torch.func.vmap: batched ATen ops rather than a loop over the batch.
TORCH_LIBRARY_IMPL(torchpar, FuncTorchBatched, m) {
  m.impl("layer_norm", &layer_norm_unfused);
}

TORCH_LIBRARY_IMPL(torchpar, Meta, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_meta);
  m.impl("layer_norm_bwd", &layer_norm_bwd_meta);
}

}  // namespace torchpar::kernels
