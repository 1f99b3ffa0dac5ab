"""Preflight checks before a long run: `python -m steadylm.doctor [train.py overrides] [deep=true]`.

Each check turns one known cause of a wasted or diverging run (a second context length, OOV token
ids, no clipping, fp16 without a scaler, a leaking causal mask, a bad init) into one table row:
check, status, evidence, fix. The checks reuse the code training runs (`validate_config`, the
DataModule, `GPT`, `Schedule`) and only catch its errors, so doctor can never disagree with startup.
It must never write anywhere but its own output folder, and never modify data or checkpoints.
"""

from steadylm.doctor.check import Check
from steadylm.doctor.cli import main, run_checks

__all__ = ["Check", "main", "run_checks"]
