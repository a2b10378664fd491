// bias + dropout + residual add on CPU: out = residual + mask * scale * (x + bias).
// Forward reads x and residual once and writes out once; backward reads dy once and
// writes dx once, with dbias summed per thread. Each row first expands its Philox words
// into a row of multipliers (scale or 0) that stays in L1/L2 while the row streams past.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <vector>

#include "kernels/cpu/philox_simd.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/vec.h"
#include "kernels/dropout.h"
#include "kernels/ops.h"

namespace torchpar::kernels::cpu::CPU_CAPABILITY {
namespace {

using at::Tensor;

template <typename T, bool Active>
void forward(const T* x, const at::opmath_type<T>* bias, const T* res, T* out,
             const DropoutRule& rule, int64_t rows, int64_t cols) {
  using IO = VecIO<T>;
  using acc_t = typename IO::acc_t;
  using Vec = typename IO::Vec;
  constexpr int64_t V = Vec::size();
  at::parallel_for(0, rows, row_grain(cols), [&](int64_t r0, int64_t r1) {
    std::vector<acc_t> mult(Active ? cols : 0);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * cols;
      const T* rr = res + r * cols;
      T* outr = out + r * cols;
      if constexpr (Active) {
        if (r + 1 < r1) {  // the next row streams in while this one's multipliers are drawn
          prefetch(xr + cols, cols);
          prefetch(rr + cols, cols);
        }
        dropout_multipliers(rule, uint64_t(r * cols), cols, mult.data());
      }
      int64_t i = 0;
      for (; i + IO::kStep <= cols; i += IO::kStep) {
        Vec a, b, ra, rb;
        IO::load2(xr + i, a, b);
        IO::load2(rr + i, ra, rb);
        a = a + Vec::loadu(bias + i);
        b = b + Vec::loadu(bias + i + V);
        if constexpr (Active) {
          a = at::vec::fmadd(a, Vec::loadu(mult.data() + i), ra);
          b = at::vec::fmadd(b, Vec::loadu(mult.data() + i + V), rb);
        } else {
          a = a + ra;
          b = b + rb;
        }
        IO::store2(outr + i, a, b);
      }
      for (; i < cols; ++i) {
        acc_t v = acc_t(xr[i]) + bias[i];
        if constexpr (Active) v = v * mult[i];
        outr[i] = T(v + acc_t(rr[i]));
      }
    }
  });
}

template <typename T, bool Active>
void backward(const T* dy, T* dx, ColumnPartials<at::opmath_type<T>>& db, const DropoutRule& rule,
              int64_t rows, int64_t cols) {
  using IO = VecIO<T>;
  using acc_t = typename IO::acc_t;
  using Vec = typename IO::Vec;
  constexpr int64_t V = Vec::size();
  at::parallel_for(0, rows, row_grain(cols), [&](int64_t r0, int64_t r1) {
    std::vector<acc_t> mult(Active ? cols : 0);
    acc_t* dbp = db.row(at::get_thread_num());
    for (int64_t r = r0; r < r1; ++r) {
      const T* dyr = dy + r * cols;
      T* dxr = dx + r * cols;
      if constexpr (Active) {
        if (r + 1 < r1) prefetch(dyr + cols, cols);
        dropout_multipliers(rule, uint64_t(r * cols), cols, mult.data());
      }
      int64_t i = 0;
      for (; i + IO::kStep <= cols; i += IO::kStep) {
        Vec a, b;
        IO::load2(dyr + i, a, b);
        if constexpr (Active) {
          a = a * Vec::loadu(mult.data() + i);
          b = b * Vec::loadu(mult.data() + i + V);
        }
        IO::store2(dxr + i, a, b);
        (Vec::loadu(dbp + i) + a).store(dbp + i);
        (Vec::loadu(dbp + i + V) + b).store(dbp + i + V);
      }
      for (; i < cols; ++i) {
        acc_t g = acc_t(dyr[i]);
        if constexpr (Active) g = g * mult[i];
        dxr[i] = T(g);
        dbp[i] += g;
      }
    }
  });
}

}  // namespace


std::tuple<Tensor, Tensor> bias_dropout_add_fwd(const Tensor& input, const Tensor& bias,
                                                    const Tensor& residual, double p,
                                                    bool training) {
  const auto [x, b, res, shape] = prepare_bias_op("bias_dropout_add", input, bias, &residual);
  const auto [rows, cols] = shape;
  check_dropout_p(p);
  const bool draw = training && p > 0.0;
  const DropoutRule rule = DropoutRule::make(p, training, draw ? draw_dropout_seed() : 0);
  Tensor out = at::empty_like(x);
  Tensor seed = at::empty({1}, x.options().dtype(at::kLong));
  seed.fill_(static_cast<int64_t>(rule.seed));
  if (x.numel() == 0) return {out, seed};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_dropout_add", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    with_flag(rule.active, [&](auto active) {
      forward<scalar_t, decltype(active)::value>(x.const_data_ptr<scalar_t>(), b.const_data_ptr<acc_t>(),
                                                 res.const_data_ptr<scalar_t>(),
                                                 out.mutable_data_ptr<scalar_t>(), rule, rows, cols);
    });
  });
  return {out, seed};
}

std::tuple<Tensor, Tensor> bias_dropout_add_bwd(const Tensor& grad_out, const Tensor& seed,
                                                    double p, bool training) {
  check_dropout_p(p);
  TORCH_CHECK(seed.numel() == 1 && seed.scalar_type() == at::kLong,
              "torchpar.bias_dropout_add backward: seed must be one int64, got ", seed.sizes(), " ",
              seed.scalar_type());
  const Tensor dy = grad_out.contiguous();
  const auto [rows, cols] = rows_cols(dy, dy.size(-1));
  const DropoutRule rule = DropoutRule::make(p, training, static_cast<uint64_t>(seed.item<int64_t>()));
  const auto acc = at::toOpMathType(dy.scalar_type());
  Tensor dx = at::empty_like(dy);
  Tensor db;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dy.scalar_type(), "bias_dropout_add_bwd", [&] {
    ColumnPartials<at::opmath_type<scalar_t>> partial(at::get_num_threads(), cols, acc);
    if (dy.numel() > 0) {
      with_flag(rule.active, [&](auto active) {
        backward<scalar_t, decltype(active)::value>(dy.const_data_ptr<scalar_t>(),
                                                    dx.mutable_data_ptr<scalar_t>(), partial, rule,
                                                    rows, cols);
      });
    }
    db = partial.sum(dy.scalar_type());
  });
  return {dx, db};
}

}  // namespace torchpar::kernels::cpu::CPU_CAPABILITY
