"""`InitLoss`: a fresh run whose first loss is far from ln(vocab_size) started from a wrong init.

A healthy init predicts nearly uniformly, so step 0's loss is ln(vocab_size) within `tolerance` nats (the
bar of doctor's `model: initial loss` row). PyTorch's default init (tied N(0, 1) embeddings, no depth
scaling) starts the tiny model at ~43 nats: nothing diverges afterwards, no other check fires, and the run
ends merely worse than a proper init would (`experiment=divergence/deep_default_init`). This check writes
one `init_loss` event (action `log`) from step 0's measurement, already on the host, so the run ends
`unstable` (`stability/instability.py`) with the fix instead of `ok`. A resumed run starts past step 0 and
is not judged again.
"""

from __future__ import annotations

import math

from steadylm.errors import ConfigError
from steadylm.stability.check import Check, StepView
from steadylm.stability.measure import Measurement
from steadylm.stability.verdict import OK, Verdict

INIT_OTHERWISE = (
    "model.init is gpt2 already: look for weights changed after init (a loaded checkpoint, a custom init), "
    "or set optim.z_loss=1e-4"
)


def init_fix(init: str, otherwise: str) -> str:
    """Advice that never recommends the setting already in use."""
    return "use model.init=gpt2 (N(0, 0.02), residual projections scaled by depth)" if init != "gpt2" else otherwise


class InitLoss(Check):
    name = "init_loss"

    def __init__(self, tolerance: float = 1.0) -> None:
        if not tolerance > 0:
            raise ConfigError(f"callbacks.stability.init_loss.tolerance={tolerance} must be > 0 (nats)")
        self.tolerance = float(tolerance)

    def verdict(self, m: Measurement, view: StepView) -> Verdict:
        self.next_step = math.inf  # judged once, on the fit's first measurement
        model_cfg = view.model_cfg  # its vocab_size and init
        vocab_size = getattr(model_cfg, "vocab_size", None)
        if m.step != 0 or not vocab_size or m.nonfinite:
            return OK
        expected = math.log(vocab_size)
        if abs(m.loss - expected) <= self.tolerance:
            return OK
        detail = {"loss": m.loss, "expected": expected, "tolerance": self.tolerance, "vocab_size": vocab_size}
        detail["init"] = getattr(model_cfg, "init", None)
        return Verdict("log", "init_loss", detail, onset=m.step)
