"""Tensor parallelism with sequence parallelism (issue 17): Megatron-LM's layers over the
C++ region operators of csrc/parallel/tensor_parallel.cpp.

Every layer is a plain ``nn.Module`` taking an explicit process group (``group=None``: the
default group), so data and pipeline parallelism compose around it; ``from_dense`` shards an
existing module exactly and ``to_dense`` gathers it back. ``torchpar.parallel.parallelize``
applies them to a model from a plan of module names. Dropout: ``torchpar.parallel.tensor.random``
(Megatron's RNG tracker: masks of their own on split activations, shared on replicated ones).
"""
from torchpar.parallel.tensor.attention import ParallelSelfAttention
from torchpar.parallel.tensor.comm import (copy_to_region, gather_from_region,
                                           gather_from_sequence_region, linear_with_async_comm,
                                           reduce_from_region, reduce_scatter_to_sequence_region,
                                           scatter_to_region, scatter_to_sequence_region)
from torchpar.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from torchpar.parallel.tensor.embedding import VocabParallelEmbedding
from torchpar.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear
from torchpar.parallel.tensor.mlp import ParallelMLP
from torchpar.parallel.tensor.random import get_rng_tracker, mark_model_parallel_rng, model_parallel_seed
from torchpar.parallel.tensor.sequence import mark_sequence_parallel

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "ParallelMLP", "ParallelSelfAttention", "mark_sequence_parallel",
    "copy_to_region", "reduce_from_region", "scatter_to_region", "gather_from_region",
    "scatter_to_sequence_region", "gather_from_sequence_region", "reduce_scatter_to_sequence_region",
    "linear_with_async_comm", "get_rng_tracker", "model_parallel_seed", "mark_model_parallel_rng",
]
