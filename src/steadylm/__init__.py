"""steadylm: train GPT-style language models that do not silently diverge."""

__version__ = "0.1.0"
