"""The transformer and its initialisation."""

from steadylm.model.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
