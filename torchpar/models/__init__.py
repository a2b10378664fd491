"""Models built from plain ``nn`` modules, made parallel by torchpar's APIs (issue 20)."""
from torchpar.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
