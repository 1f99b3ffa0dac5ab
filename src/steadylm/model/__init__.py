"""The transformer (GPT-2 or Llama shaped by config switches) and its initialisation."""

from steadylm.model.config import GPTConfig
from steadylm.model.gpt import GPT

__all__ = ["GPT", "GPTConfig"]
