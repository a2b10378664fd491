// bias + dropout + residual add on CPU: out = residual + mask * scale * (x + bias).
// Forward reads x and residual once and writes out once; backward reads dy once and
// writes dx once, with dbias summed per thread. Each chunk of a row first expands its Philox
// words into multipliers (scale or 0) that stay in L1 while the chunk streams past.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "kernels/cpu/philox_simd.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/vec.h"
#include "kernels/dropout.h"
#include "kernels/ops.h"

namespace torchpar::kernels::cpu::CPU_CAPABILITY {
namespace {

using at::Tensor;

// Rows are taken kChunk columns at a time: a chunk's multipliers stay in L1 beside the
// chunk of data they scale and the bias (a whole 4096-column row's did not, and ran 25%
// slower). 512 columns leave more of L1 to a wide row's bias than 1024 did (bfloat16 forward
// from DRAM: 7% faster at 1024 columns, 12% at 4096); 256 ran 25% slower. With AVX-512 and
// aligned blocks, 512 elements are one call of the Philox lanes' four groups.
constexpr int64_t kChunk = 512;

// B, the bias's element type: the accumulate type, or T itself for wide rows (kWideRow).
// stream: write out with non-temporal stores (stream_output).
template <typename T, bool Active, typename B>
void forward(const T* x, const B* bias, const T* res, T* out,
             const DropoutRule& rule, int64_t rows, int64_t cols, bool stream) {
  using IO = VecIO<T>;
  using acc_t = typename IO::acc_t;
  using Vec = typename IO::Vec;
  constexpr int64_t V = Vec::size();
  at::parallel_for(0, rows, row_grain(cols), [&](int64_t r0, int64_t r1) {
    alignas(64) acc_t mult[kChunk];  // one chunk's multipliers (Active)
    const int64_t end = r1 * cols;
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c0 = 0; c0 < cols; c0 += kChunk) {
        const int64_t n = std::min(kChunk, cols - c0), e = r * cols + c0;
        const T* xc = x + e;
        const T* rc = res + e;
        T* oc = out + e;
        const B* bc = bias + c0;
        if constexpr (Active) {
          // The next chunk streams in while this one's multipliers are drawn.
          prefetch(xc + n, std::min(kChunk, end - e - n));
          prefetch(rc + n, std::min(kChunk, end - e - n));
          dropout_multipliers(rule, uint64_t(e), n, mult);
        }
        int64_t i = 0;
        for (; i + IO::kStep <= n; i += IO::kStep) {
          Vec a, b, ra, rb, ba, bb;
          IO::load2(xc + i, a, b);
          IO::load2(rc + i, ra, rb);
          VecIO<B>::load2(bc + i, ba, bb);
          a = a + ba;
          b = b + bb;
          if constexpr (Active) {
            a = at::vec::fmadd(a, Vec::loadu(mult + i), ra);
            b = at::vec::fmadd(b, Vec::loadu(mult + i + V), rb);
          } else {
            a = a + ra;
            b = b + rb;
          }
          IO::store2(oc + i, a, b, stream);
        }
        for (; i < n; ++i) {
          acc_t v = acc_t(xc[i]) + acc_t(bc[i]);
          if constexpr (Active) v = v * mult[i];
          oc[i] = T(v + acc_t(rc[i]));
        }
      }
    }
    stream_fence(stream);
  });
}

// kDbias: sum dbias into db (unused otherwise). stream: write dx with non-temporal stores.
template <typename T, bool Active, bool kDbias>
void backward(const T* dy, T* dx, ColumnPartials<at::opmath_type<T>>& db, const DropoutRule& rule,
              int64_t rows, int64_t cols, bool stream) {
  using IO = VecIO<T>;
  using acc_t = typename IO::acc_t;
  using Vec = typename IO::Vec;
  constexpr int64_t V = Vec::size();
  at::parallel_for(0, rows, row_grain(cols), [&](int64_t r0, int64_t r1) {
    alignas(64) acc_t mult[kChunk];  // one chunk's multipliers (Active)
    acc_t* dbp_row = kDbias ? db.row(at::get_thread_num()) : nullptr;
    const int64_t end = r1 * cols;
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c0 = 0; c0 < cols; c0 += kChunk) {
        const int64_t n = std::min(kChunk, cols - c0), e = r * cols + c0;
        const T* dyc = dy + e;
        T* dxc = dx + e;
        acc_t* dbp = kDbias ? dbp_row + c0 : nullptr;
        if constexpr (Active) {
          prefetch(dyc + n, std::min(kChunk, end - e - n));
          dropout_multipliers(rule, uint64_t(e), n, mult);
        }
        int64_t i = 0;
        for (; i + IO::kStep <= n; i += IO::kStep) {
          Vec a, b;
          IO::load2(dyc + i, a, b);
          if constexpr (Active) {
            a = a * Vec::loadu(mult + i);
            b = b * Vec::loadu(mult + i + V);
          }
          IO::store2(dxc + i, a, b, stream);
          if constexpr (kDbias) {
            (Vec::loadu(dbp + i) + a).store(dbp + i);
            (Vec::loadu(dbp + i + V) + b).store(dbp + i + V);
          }
        }
        for (; i < n; ++i) {
          acc_t g = acc_t(dyc[i]);
          if constexpr (Active) g = g * mult[i];
          dxc[i] = T(g);
          if constexpr (kDbias) dbp[i] += g;
        }
      }
    }
    stream_fence(stream);
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
    const auto* xp = x.const_data_ptr<scalar_t>();
    const auto* rp = res.const_data_ptr<scalar_t>();
    auto* op = out.mutable_data_ptr<scalar_t>();
    const bool stream = stream_output(out);
    with_flag(rule.active, [&](auto active) {
      constexpr bool A = decltype(active)::value;
      if (!std::is_same_v<scalar_t, acc_t> && params_as_16bit(x, cols, {&bias})) {
        const Tensor b16 = bias.contiguous();
        forward<scalar_t, A>(xp, b16.const_data_ptr<scalar_t>(), rp, op, rule, rows, cols, stream);
      } else {
        forward<scalar_t, A>(xp, b.const_data_ptr<acc_t>(), rp, op, rule, rows, cols, stream);
      }
    });
  });
  return {out, seed};
}

std::tuple<Tensor, Tensor> bias_dropout_add_bwd(const Tensor& grad_out, const Tensor& seed,
                                                    double p, bool training, bool bias_grad) {
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
    ColumnPartials<at::opmath_type<scalar_t>> partial(bias_grad ? at::get_num_threads() : 0, cols,
                                                      acc);
    if (dy.numel() > 0) {
      with_flag(rule.active, [&](auto active) {
        with_flag(bias_grad, [&](auto sum) {
          backward<scalar_t, decltype(active)::value, decltype(sum)::value>(
              dy.const_data_ptr<scalar_t>(), dx.mutable_data_ptr<scalar_t>(), partial, rule, rows,
              cols, stream_output(dx));
        });
      });
    }
    db = bias_grad ? partial.sum(acc) : at::empty({0}, dy.options().dtype(acc));
  });
  return {dx, db};
}

}  // namespace torchpar::kernels::cpu::CPU_CAPABILITY
