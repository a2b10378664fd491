"""Helpers shared by the tests of torchpar's fused kernels (tests/test_kernels_*.py)."""
import math

import numpy as np
import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                   reason="no CUDA device on this machine (CPU-only torch or no GPU)")

# Tolerances against a float64 reference computed from the same (rounded) inputs: a fused
# kernel rounds once at the end, so it may be closer than torch's own low-precision path.
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


def assert_close(actual, expected, dtype, scale=1.0):
    tol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol["atol"] * scale,
                               rtol=tol["rtol"])


def noncontiguous(t):
    """The same values as ``t`` in a non-contiguous layout (a transposed copy, transposed back)."""
    if t.dim() < 2:
        return t.repeat_interleave(2)[::2]
    return t.transpose(0, -1).contiguous().transpose(0, -1)


def gelu_exact(z, approximate):
    """gelu(z) and gelu'(z) in Python floats, in forms that hold over the whole float range."""
    if math.isinf(z):
        return (z if z > 0 else math.nan), (1.0 if z > 0 else 0.0)
    if approximate == "none":
        cdf = 0.5 * math.erfc(-z / math.sqrt(2))
        return z * cdf, cdf + z * math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    k, c = math.sqrt(2 / math.pi), 0.044715
    u = k * (z + c * z**3)
    sig = lambda t: 1 / (1 + math.exp(-t)) if t >= 0 else math.exp(t) / (1 + math.exp(t))  # noqa: E731
    return z * sig(2 * u), sig(2 * u) + 2 * z * k * (1 + 3 * c * z * z) * sig(2 * u) * sig(-2 * u)


# --- Philox4x32-10 in numpy: the specification the CPU and CUDA kernels must both meet ----

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(counter_lo, key):
    """Words of Philox4x32-10 blocks with counters ``counter_lo`` (uint64 array, high 64
    counter bits zero) under a 64-bit ``key``; returns a ``[n, 4]`` uint32 array."""
    c0 = counter_lo & _MASK32
    c1 = counter_lo >> np.uint64(32)
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    k0, k1 = key & 0xFFFFFFFF, key >> 32
    for _ in range(10):
        p0 = _M0 * c0
        p1 = _M1 * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ np.uint64(k0), p1 & _MASK32,
                          (p0 >> np.uint64(32)) ^ c3 ^ np.uint64(k1), p0 & _MASK32)
        k0, k1 = (k0 + _W0) & 0xFFFFFFFF, (k1 + _W1) & 0xFFFFFFFF
    return np.stack([c0, c1, c2, c3], axis=1).astype(np.uint32)


def reference_keep_mask(seed, numel, p):
    """Element i is kept iff half i % 2 (low first) of word (i // 2) % 4 of block i // 8 is
    below round((1 - p) * 2^16)."""
    idx = np.arange(numel, dtype=np.uint64)
    words = philox4x32_10(idx >> np.uint64(3), seed & 0xFFFFFFFFFFFFFFFF)
    word = words[np.arange(numel), ((idx >> np.uint64(1)) & np.uint64(3)).astype(np.int64)]
    bits = (word.astype(np.uint64) >> (np.uint64(16) * (idx & np.uint64(1)))) & np.uint64(0xFFFF)
    threshold = int(round((1.0 - p) * 2.0**16))
    return torch.from_numpy((bits < threshold).astype(np.bool_))


def run_all_ops(shape, dtype, param_dtype=None, params_grad=True):
    """Outputs and gradients of the three ops on fixed inputs; parameters of `param_dtype`
    (float32 beside 16-bit input: mixed precision) or of the input's dtype, frozen unless
    params_grad."""
    import torchpar.nn.functional as F

    g = torch.Generator().manual_seed(3)
    cols = shape[-1]
    x, r = (torch.randn(shape, generator=g).to(dtype).requires_grad_() for _ in range(2))
    w, b, bias = (torch.randn(cols, generator=g).to(param_dtype or dtype).requires_grad_(params_grad)
                  for _ in range(3))
    dy = torch.randn(shape, generator=g).to(dtype)
    outs = []
    for fn in (lambda: F.layer_norm(x, [cols], w, b),
               lambda: F.bias_gelu(x, bias, "none"),
               lambda: F.bias_gelu(x, bias, "tanh"),
               lambda: F.bias_dropout_add(x, bias, r, 0.3, True)):
        for t in (x, r, w, b, bias):
            t.grad = None
        torch.manual_seed(11)
        y = fn()
        y.backward(dy)
        outs.append([y.detach()] + [t.grad for t in (x, r, w, b, bias) if t.grad is not None])
    return outs


def cpu_kernel_isas():
    """The copy of the CPU kernels the fused ops run by default, and every copy (narrowest
    first) that this build has and this CPU runs."""
    import torchpar

    C = torchpar._C
    default, isas = C.cpu_kernels_isa(), []
    try:
        for isa in ("AVX2", "AVX512", "AVX512_BF16"):
            try:
                C.set_cpu_kernels_isa(isa)
                isas.append(isa)
            except RuntimeError:
                pass
    finally:
        C.set_cpu_kernels_isa(default)
    return default, isas
