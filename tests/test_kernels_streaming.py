"""Outputs at least half the last-level cache in size are written with non-temporal stores
(kernels/cpu/vec.h). A store's kind must never change a value: every op, dtype and copy of the
kernels gives the same bits with every output streamed as with none, rows aligned for the
streaming stores or not."""
import pathlib
import platform

import pytest
import torch

import torchpar
from kernels_util import cpu_kernel_isas, run_all_ops

pytestmark = pytest.mark.timeout(120)
C = torchpar._C
DEFAULT, RUNNABLE = cpu_kernel_isas()


@pytest.fixture
def kernels():
    """Sets the copy of the kernels and the streaming threshold; restores both."""
    def use(isa, streaming_bytes):
        C.set_cpu_kernels_isa(isa)
        C.set_streaming_store_bytes(streaming_bytes)
    yield use
    C.set_cpu_kernels_isa(DEFAULT)
    C.set_streaming_store_bytes(-1)


def _last_level_cache_bytes():
    """The largest cache of CPU 0 as Linux's sysfs lists it (None elsewhere)."""
    sizes = []
    for index in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size))
    return max(sizes, default=None)


def test_the_default_threshold_is_half_the_last_level_cache():
    default = C.streaming_store_bytes()
    llc = _last_level_cache_bytes()
    if llc is not None and platform.machine() == "x86_64":
        # cpuinfo reads the caches from the CPU itself on x86, as Linux does; elsewhere it
        # may take them from a table of CPU models.
        assert default == llc // 2
    assert default > 0
    try:
        C.set_streaming_store_bytes(0)
        assert C.streaming_store_bytes() == 0
    finally:
        C.set_streaming_store_bytes(-1)
    assert C.streaming_store_bytes() == default


def _assert_streaming_changes_no_bit(kernels, isa, shape, dtype, *run_args):
    """Every output and gradient of run_all_ops with no output streamed, then every one
    streamed, on `isa`'s kernels: bitwise the same."""
    kernels(isa, 2**62)
    plain = run_all_ops(shape, dtype, *run_args)
    kernels(isa, 0)
    streamed = run_all_ops(shape, dtype, *run_args)
    for op_plain, op_streamed in zip(plain, streamed):
        for p, s in zip(op_plain, op_streamed):
            assert torch.equal(p, s)


# Row widths whose rows all start aligned for a vector store (64, 1024 columns), every other
# one (520 float32 columns: 2080 bytes), or misaligned ones with tails (37, 1010, 4150).
SHAPES = [(3, 37), (5, 64), (6, 1024), (8, 520), (4, 1010), (2, 4150), (2, 3, 96)]


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_streamed_outputs_are_bitwise_those_of_plain_stores(isa, dtype, shape, kernels):
    _assert_streaming_changes_no_bit(kernels, isa, shape, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("params_grad", [True, False])
def test_streaming_with_mixed_precision_or_frozen_parameters(dtype, params_grad, kernels):
    shape = (4, 4150)
    param_dtype = torch.float32 if params_grad else None
    _assert_streaming_changes_no_bit(kernels, DEFAULT, shape, dtype, param_dtype, params_grad)


def test_a_large_output_streams_by_default_and_is_read_back_by_other_threads():
    # 2 x 16 MiB of float32 at the default threshold (half of a 32 MiB cache, or less): the
    # threads' streamed rows, fenced before at::parallel_for joins, are all visible.
    rows = max(2, C.streaming_store_bytes() // (1024 * 4) + 1)
    x = torch.randn(rows, 1024)
    b = torch.randn(1024)
    y = torchpar.nn.functional.bias_gelu(x, b, "tanh")
    assert y.nbytes >= C.streaming_store_bytes()
    torch.testing.assert_close(y, torch.nn.functional.gelu(x + b, approximate="tanh"))


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("n", [0, 1, 7, 1000, 70001])
def test_the_benchs_streaming_copy_copies(isa, n, kernels):
    kernels(isa, -1)
    src = torch.randn(n + 1)[1:].contiguous()  # and a source misaligned against dst
    dst = torch.empty(n)
    C.copy_streaming_(dst, src)
    assert torch.equal(dst, src)


def test_the_benchs_streaming_copy_refuses_what_it_cannot_copy():
    with pytest.raises(RuntimeError, match="contiguous float32 CPU tensors of one size"):
        C.copy_streaming_(torch.empty(3), torch.empty(4))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        C.copy_streaming_(torch.empty(4, dtype=torch.float64), torch.empty(4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        C.copy_streaming_(torch.empty(4, 4).t(), torch.empty(4, 4))
