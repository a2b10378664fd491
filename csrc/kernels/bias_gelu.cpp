// torchpar::bias_gelu: gelu(input + bias), schema, autograd and Meta kernel. CPU and CUDA
// kernels live in cpu/bias_gelu.cpp and cuda/bias_gelu.cu.
//
// The backward recomputes gelu'(input + bias) from the saved input rather than saving the
// output: the input is saved anyway by the matmul that produced it (its weight gradient
// needs it), so this costs no extra activation memory, and the extra math is free in a
// memory-bound kernel.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/gelu_backward.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "kernels/ops.h"

namespace torchpar::kernels {
namespace {

using at::Tensor;

Tensor bias_gelu_op(const Tensor& input, const Tensor& bias, c10::string_view approximate) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchpar::bias_gelu", "")
                       .typed<Tensor(const Tensor&, const Tensor&, c10::string_view)>();
  return op.call(input, bias, approximate);
}

std::tuple<Tensor, Tensor> bias_gelu_bwd(const Tensor& grad_out, const Tensor& input,
                                         const Tensor& bias, c10::string_view approximate,
                                         bool bias_grad) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchpar::bias_gelu_bwd", "")
                       .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&,
                                                         const Tensor&, c10::string_view, bool)>();
  return op.call(grad_out, input, bias, approximate, bias_grad);
}

class BiasGeluFunction : public torch::autograd::Function<BiasGeluFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& input,
                        const Tensor& bias, c10::string_view approximate) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({input, bias});
    ctx->saved_data["approximate"] = std::string(approximate);
    return bias_gelu_op(input, bias, approximate);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto approximate = ctx->saved_data["approximate"].toStringRef();
    const bool bias_grad = ctx->needs_input_grad(1);  // a frozen bias: no column sums
    if (at::GradMode::is_enabled()) {
      // create_graph: the gradient must itself be differentiable. torch's gelu_backward has a
      // derivative of its own; computed in the accumulate type, as the fused kernel does.
      const Tensor& input = saved[0];
      const auto acc = at::toOpMathType(input.scalar_type());
      const Tensor z = input.to(acc).add(saved[1].to(acc));
      const Tensor dz = at::gelu_backward(grads[0].to(acc), z, approximate);
      const Tensor db = bias_grad ? dz.reshape({-1, dz.size(-1)}).sum(0).view(saved[1].sizes())
                                        .to(saved[1].scalar_type())
                                  : Tensor();
      return {dz.to(input.scalar_type()), db, Tensor()};
    }
    auto [dx, db] = bias_gelu_bwd(grads[0], saved[0], saved[1], approximate, bias_grad);
    return {dx, bias_grad ? db : Tensor(), Tensor()};
  }
};

// gelu(input + bias) in ATen ops (in the accumulate type, as the kernels compute), for
// forward-mode AD and functorch transforms (see needs_composite).
Tensor bias_gelu_unfused(const Tensor& input, const Tensor& bias, c10::string_view approximate) {
  check_bias_op("bias_gelu", input, bias, nullptr);
  parse_gelu_approx(approximate);
  const auto acc = at::toOpMathType(input.scalar_type());
  return at::gelu(input.to(acc).add(bias.to(acc)), approximate).to(input.scalar_type());
}

Tensor bias_gelu_autograd(const Tensor& input, const Tensor& bias, c10::string_view approximate) {
  if (needs_composite(input, bias)) return bias_gelu_unfused(input, bias, approximate);
  return BiasGeluFunction::apply(input, bias, approximate);
}

Tensor bias_gelu_meta(const Tensor& input, const Tensor& bias, c10::string_view approximate) {
  check_bias_op("bias_gelu", input, bias, nullptr);
  parse_gelu_approx(approximate);
  return at::empty_symint(input.sym_sizes(), input.options());
}

std::tuple<Tensor, Tensor> bias_gelu_bwd_meta(const Tensor& grad_out, const Tensor& input,
                                              const Tensor& bias, c10::string_view approximate,
                                              bool bias_grad) {
  return {at::empty_symint(input.sym_sizes(), input.options()),
          bias_grad ? at::empty_symint(bias.sym_sizes(), bias.options())
                    : at::empty({0}, bias.options())};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchpar, m) {
  m.def("bias_gelu(Tensor input, Tensor bias, str approximate='none') -> Tensor");
  // Returns (grad_input, grad_bias); grad_bias is empty, never summed, unless bias_grad.
  m.def("bias_gelu_bwd(Tensor grad_out, Tensor input, Tensor bias, str approximate, "
        "bool bias_grad=True) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(torchpar, Autograd, m) {
  m.impl("bias_gelu", &bias_gelu_autograd);
}

// Under torch.func.vmap: batched ATen ops rather than a loop over the batch.
TORCH_LIBRARY_IMPL(torchpar, FuncTorchBatched, m) {
  m.impl("bias_gelu", &bias_gelu_unfused);
}

TORCH_LIBRARY_IMPL(torchpar, Meta, m) {
  m.impl("bias_gelu", &bias_gelu_meta);
  m.impl("bias_gelu_bwd", &bias_gelu_bwd_meta);
}

}  // namespace torchpar::kernels
