"""The CPU kernels are built once per instruction set (AVX2, AVX512, AVX512_BF16) and the
fused ops run the widest this CPU and torch allow. The other suites test that one against
PyTorch; these pin every other copy this CPU can run to it: the same dropout mask bit for
bit, and the same values and gradients up to float rounding."""
import importlib.util
import math
import pathlib
import platform
import re
import shutil
import subprocess

import pytest
import torch

import torchpar
import torchpar.nn as tnn
from kernels_util import cpu_kernel_isas, gelu_exact, run_all_ops

pytestmark = pytest.mark.timeout(120)
F = tnn.functional
C = torchpar._C
DEFAULT, RUNNABLE = cpu_kernel_isas()
OTHERS = [isa for isa in RUNNABLE if isa != DEFAULT]


@pytest.fixture
def use_isa():
    def use(isa):
        C.set_cpu_kernels_isa(isa)
    yield use
    C.set_cpu_kernels_isa(DEFAULT)


def test_the_default_is_the_widest_this_cpu_runs():
    assert DEFAULT == RUNNABLE[-1]
    assert "AVX2" in RUNNABLE


def test_an_unknown_or_unbuilt_isa_is_refused_by_name():
    with pytest.raises(RuntimeError, match="no SSE4 CPU kernels in this build; it has AVX2"):
        C.set_cpu_kernels_isa("SSE4")
    assert C.cpu_kernels_isa() == DEFAULT


# Column counts around each copy's vector widths (8, 16, 32 floats), with tails.
# 1010 and 4150: lockstep steps (32 or 128 floats), two-vector steps (16 or 32) and a tail.
SHAPES = [(3, 37), (5, 64), (4, 1010), (2, 4150)]


@pytest.mark.skipif(not OTHERS, reason="this CPU runs only one copy of the kernels")
@pytest.mark.parametrize("isa", OTHERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_copy_computes_what_the_default_does(isa, dtype, shape, use_isa):
    expected = run_all_ops(shape, dtype)
    use_isa(isa)
    got = run_all_ops(shape, dtype)
    _assert_all_close(got, expected)


# float32 sums in another order: a few ulps; reduced types: one rounding step.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12),
             torch.bfloat16: dict(rtol=1.6e-2, atol=2e-2), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _assert_all_close(got, expected):
    for op_expected, op_got in zip(expected, got):
        for e, g in zip(op_expected, op_got):
            torch.testing.assert_close(g, e, **TOLERANCE[e.dtype])


@pytest.mark.skipif(not OTHERS, reason="this CPU runs only one copy of the kernels")
@pytest.mark.parametrize("isa", OTHERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_copy_computes_mixed_precision_as_the_default_does(isa, dtype, shape, use_isa):
    # float32 parameters beside 16-bit input: their gradients are float32 in every copy, to
    # float32's tolerance (a copy that summed 16-bit-accurate terms would miss it).
    expected = run_all_ops(shape, dtype, torch.float32)
    use_isa(isa)
    _assert_all_close(run_all_ops(shape, dtype, torch.float32), expected)


@pytest.mark.skipif(not OTHERS, reason="this CPU runs only one copy of the kernels")
@pytest.mark.parametrize("isa", OTHERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_copy_computes_frozen_parameters_as_the_default_does(isa, dtype, shape, use_isa):
    # Frozen parameters: the kernels that sum no parameter gradients, in every copy.
    expected = run_all_ops(shape, dtype, params_grad=False)
    use_isa(isa)
    _assert_all_close(run_all_ops(shape, dtype, params_grad=False), expected)


@pytest.mark.skipif(not OTHERS, reason="this CPU runs only one copy of the kernels")
@pytest.mark.parametrize("isa", OTHERS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (9, 515), (2, 4099)], ids=lambda s: "x".join(map(str, s)))
def test_every_copy_draws_the_same_dropout_mask(isa, shape, use_isa):
    def mask():
        torch.manual_seed(5)
        return F.bias_dropout_add(torch.ones(shape), torch.zeros(shape[-1]), torch.zeros(shape), 0.5, True) != 0

    expected = mask()
    use_isa(isa)
    assert torch.equal(mask(), expected)


def _ulps(got, want, dtype):
    """|got - want| in units of dtype's spacing at want (float64 tensors)."""
    a = want.abs().clamp_min(torch.finfo(dtype).tiny)
    spacing = 2.0 ** torch.floor(torch.log2(a)) * torch.finfo(dtype).eps
    return (got - want).abs() / spacing


def _gelu_grads(x, approximate):
    """Our gradient of gelu at each element of x (bias 0), and the exact one, as float64."""
    x = x.detach().requires_grad_()
    F.bias_gelu(x, torch.zeros(x.shape[-1], dtype=x.dtype), approximate).sum().backward()
    want = torch.tensor([gelu_exact(v, approximate)[1] for v in x.detach().double().flatten().tolist()],
                        dtype=torch.float64).view(x.shape)
    return x.grad.double(), want


# 183 columns: the 4-vector steps, a 2-vector step and a scalar tail on AVX-512 (64 + 32 + 23
# floats), the 8-vector lockstep, a 2-vector step and a tail with AVX2's formulas.
COLS = 183


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_copy_rounds_16bit_gelu_gradients_within_an_ulp_or_three(isa, approximate, dtype, use_isa):
    # The AVX-512 copies take 16-bit gradients from gelu_grad_table.h: over its whole range,
    # each segment's ends included, within an ulp. AVX2 computes them by the formulas, 2.3
    # float16 ulps off at worst near the root (z = -0.75), where the one-sided forms cancel;
    # a 14-bit reciprocal there once left them 19 (erf) and 50 (tanh) ulps off. Below -4 and
    # at +-inf and NaN the formulas serve every copy.
    use_isa(isa)
    bound = 1.0 if isa.startswith("AVX512") else 3.0
    edges = torch.arange(0, 17, dtype=torch.float64) * 0.375
    z = torch.cat([torch.linspace(-6, 8, 6001, dtype=torch.float64),
                   torch.linspace(-1, -0.5, 4001, dtype=torch.float64),  # every 16-bit z near the root
                   edges, -edges, edges * (1 + 2**-10), edges * (1 - 2**-10)]).to(dtype).unique()
    # A row per z, each value in every loop of the row.
    got, want = _gelu_grads(z[:, None].expand(-1, COLS).contiguous(), approximate)
    ulps = _ulps(got, want, dtype)
    assert ulps.max() <= bound, (ulps.max().item(), z[ulps.amax(1).argmax()].item())
    # Random z in rows where lanes the table covers share vectors with lanes below -4 (the
    # formulas'): each lane keeps its own accuracy, whatever its neighbours.
    mixed = (torch.rand(64, COLS, generator=torch.Generator().manual_seed(0)) * 14 - 6).to(dtype)
    mixed[::7, ::5] = torch.nan
    got, want = _gelu_grads(mixed, approximate)
    finite = ~mixed.isnan()
    ulps = _ulps(got[finite], want[finite], dtype)
    assert ulps.max() <= bound, (ulps.max().item(), mixed[finite][ulps.argmax()].item())
    assert got[~finite].isnan().all()
    got, _ = _gelu_grads(torch.tensor([[-math.inf], [math.inf]]).to(dtype).expand(-1, COLS).contiguous(),
                         approximate)
    assert got[0].abs().max() < 1e-30 and got[1].eq(1).all()


def test_gelu_grad_table_header_is_what_its_generator_writes():
    path = pathlib.Path(__file__).parents[1] / "csrc" / "kernels" / "cpu" / "gelu_grad_table.py"
    spec = importlib.util.spec_from_file_location("gelu_grad_table", path)
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert path.with_suffix(".h").read_text() == generator.render()


@pytest.mark.skipif(shutil.which("objdump") is None or platform.machine() != "x86_64",
                    reason="needs binutils' objdump on x86-64")
def test_no_avx512_instruction_outside_the_avx512_copies():
    """The extension must load and run on AVX2-only CPUs: every function holding an AVX-512
    instruction (an EVEX prefix, a zmm or mask register) must belong to an AVX-512 copy of
    the kernels. An inline function the linker took from an AVX-512 object would break that."""
    lines = subprocess.run(["objdump", "-d", "-C", "--no-addresses", torchpar._C.__file__],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    # An instruction line is "\tbytes \tmnemonic"; a long one's further bytes go on a line of
    # their own without a mnemonic, and may start with 62 (the "1f1b" of an immediate string).
    function, offenders, found = None, set(), 0
    evex = re.compile(r"^\t62 [0-9a-f ]*\t|zmm|%k[0-7]")
    for line in lines:
        if line.startswith("<") and line.endswith(">:"):
            function = line
        elif function and evex.search(line):
            found += 1
            if "AVX512" not in function:
                offenders.add(function)
    assert found, "no AVX-512 instruction found at all: is the scan still reading objdump's format?"
    assert not offenders, f"AVX-512 instructions outside the AVX-512 copies: {sorted(offenders)[:5]}"
