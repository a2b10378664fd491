// torchpar::bias_dropout_add: residual + dropout(input + bias), schema, autograd and Meta
// kernel. CPU and CUDA kernels live in cpu/bias_dropout_add.cpp and cuda/bias_dropout_add.cu.
//
// The mask is regenerated in the backward, not stored. Philox (dropout.h) makes element
// i's keep bit a pure function of (seed, i), so the forward saves one int64 and the
// backward recomputes the bits at the cost of ten multiply rounds per four elements,
// which hide behind the memory traffic. A bit-packed mask would be small (1/32 of a
// float32 activation) but is a second output to write and keep alive until the backward,
// and a second code path that CPU and CUDA would each have to get right.
#include <ATen/OpMathType.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/bernoulli.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "kernels/ops.h"

namespace torchpar::kernels {
namespace {

using at::Tensor;

std::tuple<Tensor, Tensor> bda_fwd(const Tensor& input, const Tensor& bias, const Tensor& residual,
                                   double p, bool training) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchpar::bias_dropout_add_fwd", "")
                       .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&,
                                                         const Tensor&, double, bool)>();
  return op.call(input, bias, residual, p, training);
}

std::tuple<Tensor, Tensor> bda_bwd(const Tensor& grad_out, const Tensor& seed, double p,
                                   bool training, bool bias_grad) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchpar::bias_dropout_add_bwd", "")
                       .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, double,
                                                         bool, bool)>();
  return op.call(grad_out, seed, p, training, bias_grad);
}

// grad -> (mask * scale * grad, its column sums): the backward of the dropout, as a function of
// its own. It is linear in grad, with the adjoint (gdx, gdb) -> mask * scale * (gdx + gdb), so
// its backward is itself again: double (and higher) backward through bias_dropout_add holds.
// Without bias_grad the column sums are an empty tensor, never computed.
class DropoutGradFunction : public torch::autograd::Function<DropoutGradFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const Tensor& grad, const Tensor& seed, double p,
                                                bool training, bool bias_grad) {
    at::AutoDispatchBelowADInplaceOrView guard;
    // An output nothing used comes back undefined, not as zeros of its shape (an empty column
    // sum's would not broadcast): backward below takes undefined for zero.
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({seed});
    ctx->saved_data["p"] = p;
    ctx->saved_data["training"] = training;
    ctx->saved_data["dtype"] = grad.scalar_type();
    ctx->saved_data["shape"] = c10::IValue(std::vector<c10::SymInt>(grad.sym_sizes().begin(), grad.sym_sizes().end()));
    auto [dx, db] = bda_bwd(grad, seed, p, training, bias_grad);
    return {dx, db};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const Tensor& gdx = grads[0];
    const Tensor& gdb = grads[1];
    if (!gdx.defined() && !gdb.defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    // Undefined means zero; the column sums' adjoint broadcasts gdb over the rows.
    const Tensor g = !gdb.defined()   ? gdx
                     : !gdx.defined() ? gdb.expand_symint(ctx->saved_data["shape"].toSymIntVector())
                                      : gdx.add(gdb);
    auto seed = ctx->get_saved_variables()[0];
    auto dg = DropoutGradFunction::apply(g, seed, ctx->saved_data["p"].toDouble(),
                                         ctx->saved_data["training"].toBool(), /*bias_grad=*/false);
    return {dg[0].to(ctx->saved_data["dtype"].toScalarType()), Tensor(), Tensor(), Tensor(),
            Tensor()};
  }
};

class BiasDropoutAddFunction : public torch::autograd::Function<BiasDropoutAddFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& input,
                        const Tensor& bias, const Tensor& residual, double p, bool training) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, seed] = bda_fwd(input, bias, residual, p, training);
    ctx->save_for_backward({seed});
    ctx->saved_data["p"] = p;
    ctx->saved_data["training"] = training;
    ctx->saved_data["input_dtype"] = input.scalar_type();
    ctx->saved_data["bias_dtype"] = bias.scalar_type();
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto seed = ctx->get_saved_variables()[0];
    const bool bias_grad = ctx->needs_input_grad(1);  // a frozen bias: no column sums
    auto d = DropoutGradFunction::apply(grads[0], seed, ctx->saved_data["p"].toDouble(),
                                        ctx->saved_data["training"].toBool(), bias_grad);
    // d(out)/d(residual) is the identity: the incoming gradient passes through untouched.
    // Mixed precision (kernels/ops.h): d[0] has the output's dtype and d[1] the accumulate type.
    return {d[0].to(ctx->saved_data["input_dtype"].toScalarType()),
            bias_grad ? d[1].to(ctx->saved_data["bias_dtype"].toScalarType()) : Tensor(),
            grads[0], Tensor(), Tensor()};
  }
};

// residual + dropout(input + bias) in ATen ops, for forward-mode AD and functorch transforms
// (see needs_composite). The multipliers (scale or 0): under forward-mode AD alone the fused
// kernel draws them (ones in, multipliers out), the same single draw, hence the mask the fused
// path would have used; under a functorch transform they come from torch's bernoulli, whose
// batching rules give vmap's `randomness` its meaning ("error", "same" or "different").
Tensor bda_unfused(const Tensor& input, const Tensor& bias, const Tensor& residual, double p,
                   bool training, bool functorch) {
  check_bias_op("bias_dropout_add", input, bias, &residual);
  check_dropout_p(p);
  const auto dtype = bias_op_dtype(input, &residual);
  const auto acc = at::toOpMathType(dtype);
  const auto opts = input.options().dtype(acc);
  Tensor z = input.to(acc).add(bias.to(acc));
  if (training && p >= 1.0) {
    z = z.mul(0);
  } else if (training && p > 0.0) {
    Tensor mult;
    if (functorch) {
      mult = at::bernoulli(at::full_symint(input.sym_sizes(), 1.0 - p, opts)).div_(1.0 - p);
    } else {
      at::AutoDispatchBelowADInplaceOrView guard;
      mult = std::get<0>(bda_fwd(at::ones_symint(input.sym_sizes(), opts),
                                 at::zeros_symint({input.sym_size(-1)}, opts),
                                 at::zeros_symint(input.sym_sizes(), opts), p, /*training=*/true));
    }
    z = z.mul(mult);
  }
  return z.add(residual.to(acc)).to(dtype);
}

Tensor bda_batched(const Tensor& input, const Tensor& bias, const Tensor& residual, double p,
                   bool training) {
  return bda_unfused(input, bias, residual, p, training, /*functorch=*/true);
}

Tensor bda_autograd(const Tensor& input, const Tensor& bias, const Tensor& residual, double p,
                    bool training) {
  if (needs_composite(input, bias, residual)) {
    return bda_unfused(input, bias, residual, p, training, in_functorch_transform());
  }
  return BiasDropoutAddFunction::apply(input, bias, residual, p, training);
}

Tensor bda_composite(const Tensor& input, const Tensor& bias, const Tensor& residual, double p,
                     bool training) {
  return std::get<0>(bda_fwd(input, bias, residual, p, training));
}

std::tuple<Tensor, Tensor> bda_fwd_meta(const Tensor& input, const Tensor& bias,
                                        const Tensor& residual, double p, bool training) {
  check_bias_op("bias_dropout_add", input, bias, &residual);
  check_dropout_p(p);
  return {at::empty_symint(input.sym_sizes(), input.options().dtype(bias_op_dtype(input, &residual))),
          at::empty({1}, input.options().dtype(at::kLong))};
}

std::tuple<Tensor, Tensor> bda_bwd_meta(const Tensor& grad_out, const Tensor& seed, double p,
                                        bool training, bool bias_grad) {
  const auto acc = grad_out.options().dtype(at::toOpMathType(grad_out.scalar_type()));
  return {at::empty_symint(grad_out.sym_sizes(), grad_out.options()),
          bias_grad ? at::empty_symint({grad_out.sym_size(-1)}, acc) : at::empty({0}, acc)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchpar, m) {
  m.def("bias_dropout_add(Tensor input, Tensor bias, Tensor residual, float p=0.1, "
        "bool training=True) -> Tensor");
  // Returns (output, seed): seed is the int64 Philox key the mask was drawn with, on
  // input's device. It draws from torch's default generator, hence the tag: compilers
  // must neither merge two calls nor reorder them across other random ops.
  m.def("bias_dropout_add_fwd(Tensor input, Tensor bias, Tensor residual, float p, "
        "bool training) -> (Tensor, Tensor)",
        {at::Tag::nondeterministic_seeded});
  // Returns (grad_input, grad_bias): grad_input in grad_out's dtype, grad_bias in its accumulate
  // type (float32 for 16-bit), for the caller to cast to the bias's, or empty, never summed,
  // unless bias_grad; the mask is regenerated from `seed`.
  m.def("bias_dropout_add_bwd(Tensor grad_out, Tensor seed, float p, bool training, "
        "bool bias_grad=True) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(torchpar, Autograd, m) {
  m.impl("bias_dropout_add", &bda_autograd);
}

TORCH_LIBRARY_IMPL(torchpar, CompositeExplicitAutograd, m) {
  m.impl("bias_dropout_add", &bda_composite);
}

// Under torch.func.vmap the op decomposes into ATen ops, whose rules give the mask vmap's
// `randomness`. FuncTorchBatched catches calls with a batched argument (else functorch would
// loop over the batch, drawing a mask per example whatever `randomness` says); FuncTorchVmapMode,
// on for the whole transform, catches the rest (dropout of a tensor vmap does not batch, which
// would otherwise reach the fused kernel and share one mask), as it does for torch's random ops.
TORCH_LIBRARY_IMPL(torchpar, FuncTorchBatched, m) {
  m.impl("bias_dropout_add", &bda_batched);
}

TORCH_LIBRARY_IMPL(torchpar, FuncTorchVmapMode, m) {
  m.impl("bias_dropout_add", &bda_batched);
}

TORCH_LIBRARY_IMPL(torchpar, Meta, m) {
  m.impl("bias_dropout_add_fwd", &bda_fwd_meta);
  m.impl("bias_dropout_add_bwd", &bda_bwd_meta);
}

}  // namespace torchpar::kernels
