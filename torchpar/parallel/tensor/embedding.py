"""The vocabulary-parallel embedding (Megatron-LM, arXiv:1909.08053, section 3).

The table is split by rows: rank r holds tokens ``[r V/tp, (r+1) V/tp)``. Each rank looks up
the tokens it holds, writes zeros for the others, and the sum over ranks (an all-reduce, or
under sequence parallelism a reduce-scatter along the sequence) is the full embedding. The
table's memory per rank is ``V/tp``, as for the output layer and
``vocab_parallel_cross_entropy`` that usually share it.
"""
import torch
from torch import nn
from torch.nn import functional as F

from torchpar.parallel.tensor import comm


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim)`` with rows split across ``group``.

    Input: token ids, ``[s, b]`` under sequence parallelism (dim 0 the sequence; the output
    is then this rank's shard ``[s/tp, b, embedding_dim]``), any shape otherwise.
    ``init_method``: Megatron's, a function filling the whole table in place before it is split.
    """

    def __init__(self, num_embeddings, embedding_dim, group=None, *, sequence_parallel=False,
                 dtype=None, init_method=None, sequence_dim=0, _weight=None):
        super().__init__()
        self.group = comm.resolve_group(group)
        self.rank, self.tp = comm.group_rank_and_size(self.group)
        comm.check_divisible(num_embeddings, self.tp, "VocabParallelEmbedding num_embeddings (the vocabulary)")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel and self.tp > 1
        self.sequence_dim = comm.check_sequence_dim(sequence_dim)
        self.vocab_start = self.rank * (num_embeddings // self.tp)
        self.vocab_end = self.vocab_start + num_embeddings // self.tp
        if _weight is None:  # the whole table (Megatron's init_method fills it in place), then this rank's rows
            _weight = nn.Embedding(num_embeddings, embedding_dim, dtype=dtype).weight
            if init_method is not None:
                with torch.no_grad():
                    init_method(_weight)
        self.weight = nn.Parameter(_weight.detach()[self.vocab_start:self.vocab_end].clone())

    @classmethod
    def from_dense(cls, module: nn.Embedding, group=None, *, sequence_parallel=False, sequence_dim=0):
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding.from_dense needs an nn.Embedding, got {type(module).__name__}")
        if module.padding_idx is not None or module.max_norm is not None or module.sparse:
            raise ValueError("VocabParallelEmbedding.from_dense: padding_idx, max_norm and sparse "
                             "are not supported")
        return cls(module.num_embeddings, module.embedding_dim, group, sequence_parallel=sequence_parallel,
                   sequence_dim=sequence_dim, _weight=module.weight)

    @torch.no_grad()
    def to_dense(self) -> nn.Embedding:
        out = nn.Embedding(self.num_embeddings, self.embedding_dim, dtype=self.weight.dtype,
                           device=self.weight.device)
        out.weight.copy_(comm.gather_from_sequence_region(self.weight.detach(), self.group))
        return out

    def forward(self, input):
        if self.tp == 1:
            return F.embedding(input, self.weight)
        comm.check_same_sizes(input, self.group, "VocabParallelEmbedding input")
        if self.sequence_parallel:
            d = self.sequence_dim
            if input.dim() <= d or input.size(d) % self.tp:
                raise ValueError(f"VocabParallelEmbedding(sequence_parallel=True): the sequence length "
                                 f"(dim {d} of the input, shape {tuple(input.shape)}) must be divisible by "
                                 f"the tensor-parallel group size ({self.tp})")
        self._check_ids(input)
        outside = (input < self.vocab_start) | (input >= self.vocab_end)
        local = (input - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return comm.reduce_scatter_along(partial, self.sequence_dim, self.group)
        return comm.reduce_from_region(partial, self.group)

    def _check_ids(self, input):
        """An id outside the vocabulary is held by no rank and would sum to a row of zeros: an
        IndexError instead, as ``nn.Embedding`` raises. The ranks of a tensor-parallel group look
        up the same ids, so each finds the same answer without a collective. On a GPU the check
        is a device-side assert (no host sync per forward), as ``nn.Embedding``'s."""
        bad = (input < 0) | (input >= self.num_embeddings)
        if input.is_cuda:
            torch._assert_async(~bad.any(), f"VocabParallelEmbedding: a token id is out of range [0, "
                                            f"{self.num_embeddings})")
        elif bad.any():
            raise IndexError(f"VocabParallelEmbedding: token id {input[bad][0].item()} is out of range for "
                             f"the vocabulary of {self.num_embeddings}")

    def extra_repr(self):
        return (f"{self.num_embeddings}, {self.embedding_dim} (rows {self.vocab_start}:{self.vocab_end} "
                f"on this rank of {self.tp}), sequence_parallel={self.sequence_parallel}")
