"""Which precision a run trains in (`auto` resolved, legacy names normalised): one place, so all agree."""

from __future__ import annotations

import os
from typing import Any

import torch

from steadylm.compat import cpu_has_bf16

AUTO_PRECISION_ENV = "STEADYLM_AUTO_PRECISION"
LEGACY = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true"}  # -> "<dtype>-<mode>"


def resolve_precision(precision: Any, accelerator: str) -> str:
    """`auto`: bf16-mixed where the resolved `accelerator` has bf16 units (a CPU without them emulates it ~10x
    slower), else fp32; `STEADYLM_AUTO_PRECISION` overrides it, so tests can run as the other kind of machine."""
    precision = str(precision)
    if precision != "auto":
        return LEGACY.get(precision, precision)
    if os.environ.get(AUTO_PRECISION_ENV):
        return os.environ[AUTO_PRECISION_ENV]
    supported = torch.cuda.is_bf16_supported() if accelerator == "cuda" else cpu_has_bf16()
    return "bf16-mixed" if supported else "32-true"
