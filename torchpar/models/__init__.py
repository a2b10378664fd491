"""Models built from plain ``nn`` modules, made parallel by torchpar's APIs (issue 20):
``GPT`` and, on a dp x tp x pp layout, ``ParallelGPT``."""
from torchpar.models.gpt import GPT, GPTConfig
from torchpar.models.parallel_gpt import Layout, ParallelGPT

__all__ = ["GPT", "GPTConfig", "Layout", "ParallelGPT"]
