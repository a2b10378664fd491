"""Inputs and exact references for collective tests.

Every rank can build every rank's input (seeded by rank), so each rank checks its result
against a reference computed locally with torch, and against gloo where gloo supports the
dtype and op. Inputs are small integers, so sums and products are exact in every dtype.
"""
import torch
import torch.distributed as dist

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool]
# 0, 1, odd, and larger than the test pools' 64 KiB slot even in the widest dtype.
SIZES = [0, 1, 7, 20011]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]


def op_applies(op, dtype):
    floating = dtype.is_floating_point
    if op in ("BAND", "BOR", "BXOR"):
        return not floating
    if op == "PREMUL_SUM":
        return floating
    if op == "AVG":
        return dtype != torch.bool
    return True


def make_input(rank, n, dtype, salt=0):
    g = torch.Generator().manual_seed(7919 * salt + 104729 * rank + n)
    v = torch.randint(-3, 4, (n,), generator=g)
    if dtype == torch.bool:
        return v > 0
    if dtype == torch.uint8:
        v = v.abs()
    return v.to(dtype)


def reduce_op(op, factor=2.0):
    if op == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(factor)
    return getattr(dist.ReduceOp, op)


def reference(inputs, op, factor=2.0):
    """What a reduction of `inputs` (one tensor per rank) must give."""
    dtype = inputs[0].dtype
    if dtype == torch.bool:
        x = torch.stack(inputs)
        if op in ("SUM", "MAX", "BOR"):
            return x.any(0)
        if op in ("PRODUCT", "MIN", "BAND"):
            return x.all(0)
        if op == "BXOR":
            return (x.sum(0) % 2).bool()
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    x = torch.stack([t.to(wide) for t in inputs])
    if op == "SUM":
        out = x.sum(0)
    elif op == "PREMUL_SUM":
        out = (x * factor).sum(0)
    elif op == "AVG":
        out = x.sum(0) / len(inputs) if dtype.is_floating_point else torch.div(x.sum(0), len(inputs), rounding_mode="trunc")
    elif op == "PRODUCT":
        out = x.prod(0)
    elif op == "MIN":
        out = x.min(0).values
    elif op == "MAX":
        out = x.max(0).values
    else:
        out = x[0].clone()
        for t in x[1:]:
            out = {"BAND": out & t, "BOR": out | t, "BXOR": out ^ t}[op]
    return out.to(dtype)


def assert_equal(actual, expected, what):
    if actual.dtype.is_floating_point:
        # Exact for integer-valued data; AVG divides once after an exact sum.
        torch.testing.assert_close(actual, expected, rtol=1e-2 if actual.dtype in (torch.float16, torch.bfloat16) else 1e-6,
                                   atol=0, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(actual, expected), f"{what}: got {actual[:8].tolist()} expected {expected[:8].tolist()}"


def strided(t):
    """A non-contiguous tensor holding the values of `t`."""
    base = torch.zeros(t.numel() * 2, dtype=t.dtype)
    view = base[::2]
    view.copy_(t)
    return view


def gloo_agrees(fn):
    """Runs `fn` on gloo; returns its result, or None when gloo does not support the case."""
    try:
        return fn()
    except (RuntimeError, ValueError):
        return None
