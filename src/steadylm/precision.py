"""Which precision a run trains in: `auto` resolved for this machine, Lightning's legacy names normalised.

One place, so `train.py`, the memory check and `doctor` always agree on the path a run takes.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from steadylm.compat import cpu_has_bf16

AUTO_PRECISION_ENV = "STEADYLM_AUTO_PRECISION"
# Lightning's legacy spellings, normalised to the "<dtype>-<mode>" names.
LEGACY = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true"}


def resolve_precision(precision: Any, accelerator: str) -> str:
    """`auto`: bf16-mixed where the hardware has bf16 units, else fp32. `accelerator` is the resolved one
    (`steadylm.devices.Devices.accelerator`: cpu, cuda or mps).

    On a CPU without native bf16 (no AVX512-BF16/AMX) autocast emulates it and runs ~10x slower
    (`make bench`), so it is only chosen where oneDNN reports support. `STEADYLM_AUTO_PRECISION`
    overrides the choice, so the test suite can be run once as a machine of the other kind would run it.
    """
    precision = str(precision)
    if precision != "auto":
        return LEGACY.get(precision, precision)
    if os.environ.get(AUTO_PRECISION_ENV):
        return os.environ[AUTO_PRECISION_ENV]
    if accelerator == "cuda":
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "32-true"
    return "bf16-mixed" if cpu_has_bf16() else "32-true"
