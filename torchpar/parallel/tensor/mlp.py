"""The tensor-parallel MLP: ``fc2(gelu(fc1(x)))`` with fc1 column-parallel and fc2 row-parallel
(Megatron-LM, arXiv:1909.08053, figure 3a): the GeLU runs on each rank's slice of the hidden
features, so the block communicates once forward and once backward.

fc1's bias is added inside torchpar's fused bias+GeLU kernel; with a ``residual``, fc2's bias,
dropout and the residual add are one fused bias+dropout+add. Its mask comes from the default
generator (the same on every rank: the output is replicated) or, under sequence parallelism,
from the model-parallel stream of ``torchpar.parallel.tensor.random`` (the output is this
rank's sequence shard).
"""
from torch import nn
from torch.nn import functional as F

from torchpar.nn import functional as TF
from torchpar.parallel.tensor import comm
from torchpar.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear
from torchpar.parallel.tensor.random import bias_dropout_add


class ParallelMLP(nn.Module):
    """``dropout(fc2(gelu(fc1(x))))`` (plus ``residual`` when given), hidden features split
    across ``group``. ``x`` is ``[s, b, hidden_size]`` (``[s/tp, b, hidden_size]`` with
    ``sequence_parallel``, and so is the output)."""

    def __init__(self, hidden_size, ffn_hidden_size=None, bias=True, dropout=0.0, sequence_parallel=False,
                 group=None, dtype=None, *, _dense=None):
        super().__init__()
        ffn_hidden_size = ffn_hidden_size or 4 * hidden_size
        self.group = comm.resolve_group(group)
        _, tp = comm.group_rank_and_size(self.group)
        comm.check_divisible(ffn_hidden_size, tp, "ParallelMLP ffn_hidden_size")
        if _dense is None:
            _dense = (nn.Linear(hidden_size, ffn_hidden_size, bias=bias, dtype=dtype),
                      nn.Linear(ffn_hidden_size, hidden_size, bias=bias, dtype=dtype))
        fc1, fc2 = _dense
        self.fc1 = ColumnParallelLinear.from_dense(fc1, self.group, sequence_parallel=sequence_parallel,
                                                   skip_bias_add=True)
        self.fc2 = RowParallelLinear.from_dense(fc2, self.group, sequence_parallel=sequence_parallel,
                                                skip_bias_add=True)
        self.fc2.check_input_sizes = False  # fc1 has checked them: fc2's input is fc1's output
        self.dropout = dropout

    @classmethod
    def from_dense(cls, module: nn.Module, group=None, *, sequence_parallel=False, dropout=None):
        """Shards a dense MLP: any module whose ``nn.Linear`` submodules are exactly two, the
        first hidden -> ffn and the second ffn -> hidden, with an exact (erf) GeLU between them
        (``nn.Sequential(nn.Linear, nn.GELU(), nn.Linear)``, or attributes fc1/fc2)."""
        linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
        if len(linears) != 2 or linears[0].out_features != linears[1].in_features:
            raise TypeError(f"ParallelMLP.from_dense: {type(module).__name__} must hold exactly two "
                            f"nn.Linear (hidden -> ffn -> hidden); found {[tuple(l.weight.shape) for l in linears]}")
        # ParallelMLP always applies the exact GeLU: any other leaf module (another activation, a
        # norm) would be silently dropped, so the shard would not compute what the dense module does.
        for name, m in module.named_modules():
            exact_gelu = isinstance(m, nn.GELU) and m.approximate == "none"
            if next(m.children(), None) is None and not (exact_gelu or isinstance(m, (nn.Linear, nn.Dropout, nn.Identity))):
                raise TypeError(f"ParallelMLP.from_dense: {type(module).__name__} holds {name!r} ({m!r}); "
                                f"only nn.Linear, an exact nn.GELU() and nn.Dropout are supported")
        if dropout is None:
            dropouts = [m.p for m in module.modules() if isinstance(m, nn.Dropout)]
            dropout = dropouts[0] if dropouts else 0.0
        fc1, fc2 = linears
        return cls(fc1.in_features, fc1.out_features, fc1.bias is not None, dropout, sequence_parallel,
                   group, fc1.weight.dtype, _dense=(fc1, fc2))

    def to_dense(self) -> nn.Sequential:
        """``nn.Sequential(fc1, nn.GELU(), fc2)`` with the whole weights (a collective)."""
        return nn.Sequential(self.fc1.to_dense(), nn.GELU(), self.fc2.to_dense())

    def forward(self, x, residual=None):
        h, b1 = self.fc1(x)
        h = TF.bias_gelu(h, b1) if b1 is not None else F.gelu(h)
        out, b2 = self.fc2(h)
        return bias_dropout_add(out, b2, residual, self.dropout, self.training, split=self.fc2.sequence_parallel)
