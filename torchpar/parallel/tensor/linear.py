"""Column- and row-parallel linear layers (Megatron-LM, arXiv:1909.08053, section 3).

``ColumnParallelLinear`` splits the weight by output features: every rank takes the whole
input and produces its slice of the output. ``RowParallelLinear`` splits it by input features:
every rank takes its slice of the input and produces a partial sum of the whole output, which
is all-reduced (under sequence parallelism, reduce-scattered along the sequence, arXiv:2205.05198).
A column layer followed by a row layer (the MLP, attention) thus communicates once forward and
once backward.

Both initialise the full weight as ``nn.Linear(in_features, out_features)`` would (same RNG
draws on every rank), or with Megatron's ``init_method`` (bias zero, as Megatron's), and keep
their shard, so a tensor-parallel model built from a seed equals the dense model built from that
seed. Unlike Megatron-core's layers, which always return ``(output, bias)``, they return the
output alone unless ``skip_bias_add`` (then ``(output, bias)``): they replace ``nn.Linear`` in a
model (``parallelize``), so they keep its return. ``from_dense`` shards an existing ``nn.Linear`` and
``to_dense`` gathers it back.
"""
import torch
from torch import nn
from torch.nn import functional as F

from torchpar.parallel.tensor import comm


def _dense_linear(in_features, out_features, bias, dtype, init_method=None):
    """The whole layer, initialised as ``nn.Linear``, or, with Megatron's ``init_method`` (a
    function filling a weight in place), its weight by that and its bias with zeros, as
    Megatron-LM initialises the master weight before splitting it."""
    dense = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    if init_method is not None:
        with torch.no_grad():
            init_method(dense.weight)
            if dense.bias is not None:
                dense.bias.zero_()
    return dense


def _check_sequence_input(layer, input):
    """A sequence-parallel layer's input has the sequence on ``layer.sequence_dim`` and features
    after it (checked before the layer's first collective)."""
    if layer.sequence_parallel and input.dim() < layer.sequence_dim + 2:
        raise ValueError(f"{type(layer).__name__}(sequence_parallel=True, sequence_dim={layer.sequence_dim}) needs "
                         f"an input with its sequence on dim {layer.sequence_dim} and features after it; got "
                         f"{tuple(input.shape)}")


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split by rows (output features) across ``group``.

    The input is the full activation ``[..., in_features]`` or, with ``sequence_parallel``,
    this rank's sequence shard ``[s/tp, b, in_features]`` (all-gathered inside). The output
    is this rank's ``out_features / tp`` features, or all of them with ``gather_output`` (also
    under sequence parallelism: an output layer whose logits are wanted whole, over the whole
    sequence).
    With ``skip_bias_add`` (Megatron's) the bias is returned beside the output instead of
    added, for a fused bias+GeLU or bias+dropout+add after it.

    ``stride`` (Megatron's name): the output is that many equal blocks side by side, as a
    fused q/k/v projection's ``[q; k; v]`` (3) or a gate/up projection's (2); each block is
    split across the ranks, so rank r holds ``[q_r; k_r; v_r]`` and its output is the q, k and
    v of its own heads (a plain split of the concatenation would give rank 0 all of q and
    half of k). ``gather_output`` and ``to_dense`` put the blocks back in the dense order.
    """

    def __init__(self, in_features, out_features, bias=True, gather_output=False,
                 sequence_parallel=False, group=None, dtype=None, *, skip_bias_add=False, stride=1,
                 init_method=None, sequence_dim=0, _weight=None, _bias=None):
        super().__init__()
        self.group = comm.resolve_group(group)
        self.rank, self.tp = comm.group_rank_and_size(self.group)
        if stride < 1:
            raise ValueError(f"ColumnParallelLinear: stride must be >= 1, got {stride}")
        comm.check_divisible(out_features, self.tp, "ColumnParallelLinear out_features")
        if out_features % (stride * self.tp):
            raise ValueError(f"torchpar tensor parallel: ColumnParallelLinear out_features ({out_features}) "
                             f"must be {stride} equal fused blocks, each divisible by the tensor-parallel "
                             f"group size ({self.tp})")
        self.stride = stride
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and self.tp > 1
        self.sequence_dim = comm.check_sequence_dim(sequence_dim)
        self.skip_bias_add = skip_bias_add
        self.check_input_sizes = True  # one tiny all-gather per call; see _check_input
        if _weight is None:
            dense = _dense_linear(in_features, out_features, bias, dtype, init_method)
            _weight, _bias = dense.weight, dense.bias
        self.weight = nn.Parameter(self._shard(_weight.detach()).clone())
        self.bias = nn.Parameter(self._shard(_bias.detach()).clone()) if _bias is not None else None

    def _shard(self, t):
        return torch.cat([block.chunk(self.tp, 0)[self.rank] for block in t.chunk(self.stride, 0)])

    def _unshard(self, t):
        # Inverse of _shard over the all-gathered [rank 0's blocks; rank 1's; ...] along dim -1
        # of an output or dim 0 of a parameter (moved last here): the dense block order.
        if self.stride == 1:
            return t
        return t.unflatten(-1, (self.tp, self.stride, -1)).transpose(-3, -2).flatten(-3)

    @classmethod
    def from_dense(cls, module: nn.Linear, group=None, *, gather_output=False, sequence_parallel=False,
                   skip_bias_add=False, stride=1, sequence_dim=0):
        """This rank's shard of ``module`` (an ``nn.Linear``), computing the same function."""
        if not isinstance(module, nn.Linear):
            raise TypeError(f"ColumnParallelLinear.from_dense needs an nn.Linear, got {type(module).__name__}")
        return cls(module.in_features, module.out_features, module.bias is not None, gather_output,
                   sequence_parallel, group, module.weight.dtype, skip_bias_add=skip_bias_add, stride=stride,
                   sequence_dim=sequence_dim, _weight=module.weight, _bias=module.bias)

    @torch.no_grad()
    def to_dense(self) -> nn.Linear:
        """The whole layer as an ``nn.Linear`` (every rank gets it; a collective)."""
        out = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        dtype=self.weight.dtype, device=self.weight.device)
        weight = comm.gather_from_sequence_region(self.weight.detach(), self.group)
        out.weight.copy_(self._unshard(weight.t()).t())
        if self.bias is not None:
            out.bias.copy_(self._unshard(comm.gather_from_sequence_region(self.bias.detach(), self.group)))
        return out

    def forward(self, input):
        if self.check_input_sizes:
            # Before the first collective: ranks whose inputs differ (a different sequence
            # length) would otherwise reach the all-gather/all-reduce with different sizes.
            comm.check_same_sizes(input, self.group, f"{type(self).__name__} input")
            _check_sequence_input(self, input)
        bias = None if self.skip_bias_add else self.bias
        sequence_first = self.sequence_parallel and self.sequence_dim != 0
        if sequence_first:  # the all-gather runs on dim 0: [b, s/tp, h] -> [s/tp, b, h] and back
            input = input.transpose(0, self.sequence_dim)
        out = comm.linear_with_async_comm(input, self.weight, bias, self.group, self.sequence_parallel)
        if sequence_first:
            out = out.transpose(0, self.sequence_dim)
        if self.gather_output:
            out = self._unshard(comm.gather_from_region(out, self.group))
        return (out, self.bias) if self.skip_bias_add else out

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.out_features // self.tp} on this rank of {self.tp}), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}"
                f"{f', stride={self.stride}' if self.stride > 1 else ''}")


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split by columns (input features) across ``group``.

    The input is this rank's ``in_features / tp`` slice (``input_is_parallel``, the output of
    a ColumnParallelLinear) or the full activation, then split here. The output is the full
    ``[..., out_features]``, all-reduced; with ``sequence_parallel`` it is reduce-scattered to
    this rank's sequence shard ``[s/tp, b, out_features]`` instead. The bias is added once,
    after the reduction.
    """

    def __init__(self, in_features, out_features, bias=True, input_is_parallel=True,
                 sequence_parallel=False, group=None, dtype=None, *, skip_bias_add=False,
                 init_method=None, sequence_dim=0, _weight=None, _bias=None):
        super().__init__()
        self.group = comm.resolve_group(group)
        self.rank, self.tp = comm.group_rank_and_size(self.group)
        comm.check_divisible(in_features, self.tp, "RowParallelLinear in_features")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel and self.tp > 1
        self.sequence_dim = comm.check_sequence_dim(sequence_dim)
        self.skip_bias_add = skip_bias_add
        # One tiny all-gather per call, as ColumnParallelLinear's: ranks whose sequence lengths
        # differ would otherwise reach the all-reduce / reduce-scatter with different sizes (gloo
        # aborts the process). ParallelMLP and ParallelSelfAttention turn it off on their row
        # layer, whose input comes from a column layer that has checked the same sizes.
        self.check_input_sizes = True
        if _weight is None:
            dense = _dense_linear(in_features, out_features, bias, dtype, init_method)
            _weight, _bias = dense.weight, dense.bias
        self.weight = nn.Parameter(_weight.detach().chunk(self.tp, 1)[self.rank].clone())
        self.bias = nn.Parameter(_bias.detach().clone()) if _bias is not None else None

    @classmethod
    def from_dense(cls, module: nn.Linear, group=None, *, input_is_parallel=True, sequence_parallel=False,
                   skip_bias_add=False, sequence_dim=0):
        """This rank's shard of ``module`` (an ``nn.Linear``), computing the same function."""
        if not isinstance(module, nn.Linear):
            raise TypeError(f"RowParallelLinear.from_dense needs an nn.Linear, got {type(module).__name__}")
        return cls(module.in_features, module.out_features, module.bias is not None, input_is_parallel,
                   sequence_parallel, group, module.weight.dtype, skip_bias_add=skip_bias_add,
                   sequence_dim=sequence_dim, _weight=module.weight, _bias=module.bias)

    @torch.no_grad()
    def to_dense(self) -> nn.Linear:
        """The whole layer as an ``nn.Linear`` (every rank gets it; a collective)."""
        out = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        dtype=self.weight.dtype, device=self.weight.device)
        out.weight.copy_(comm.gather_from_region(self.weight.detach(), self.group))
        if self.bias is not None:
            out.bias.copy_(self.bias)
        return out

    def _bias(self):
        # Under sequence parallelism each rank adds the bias to its sequence shard only, so its
        # gradient is a partial sum: copy_to_region all-reduces it in backward.
        if self.bias is None or not self.sequence_parallel:
            return self.bias
        return comm.copy_to_region(self.bias, self.group)

    def forward(self, input):
        if self.check_input_sizes:
            comm.check_same_sizes(input, self.group, "RowParallelLinear input")
            _check_sequence_input(self, input)
        if not self.input_is_parallel:
            input = comm.scatter_to_region(input, self.group)
        partial = F.linear(input, self.weight)
        if self.sequence_parallel:
            out = comm.reduce_scatter_along(partial, self.sequence_dim, self.group)
        else:
            out = comm.reduce_from_region(partial, self.group)
        bias = self._bias()
        if self.skip_bias_add:
            return out, bias
        return out if bias is None else out + bias

    def extra_repr(self):
        return (f"in_features={self.in_features} ({self.in_features // self.tp} on this rank of "
                f"{self.tp}), out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")
