"""`InitLoss`: a fresh run whose step-0 loss is not ln(vocab_size) within `tolerance` nats started from a wrong init
(PyTorch's default init starts the tiny model at ~43 nats, and then nothing diverges and no other check fires): one
`init_loss` event makes the run end `unstable` with the fix instead of `ok`. A resumed run is not judged again, and
a run that starts from trained weights (`init_from`) has no init to judge."""

from __future__ import annotations

import math

from steadylm.errors import ConfigError
from steadylm.stability.check import Check, StepView
from steadylm.stability.verdict import OK, Verdict

INIT_OTHERWISE = (
    "model.init is gpt2 already: look for weights changed after init (a loaded checkpoint, a custom init), "
    "or set optim.z_loss=1e-4"
)


def init_fix(init: str, otherwise: str) -> str:
    """Advice that never recommends the setting already in use."""
    return "use model.init=gpt2 (N(0, 0.02), residual projections scaled by depth)" if init != "gpt2" else otherwise


def explain(events: list[dict], lr: float | None, cut: str | None) -> str:
    """The run's `unstable` line (`stability.instability`): a wrong init is named before any other cause."""
    d = next(e["detail"] for e in events if e.get("kind") == "init_loss")
    return (
        f"the initial loss was {d['loss']:.3g} nats, ln({d['vocab_size']}) = {d['expected']:.3g} expected: the "
        f"init is wrong (over-confident logits); fix: {init_fix(d.get('init'), INIT_OTHERWISE)}"
    )


class InitLoss(Check):
    name = "init_loss"

    def __init__(self, tolerance: float = 1.0) -> None:
        if not tolerance > 0:
            raise ConfigError(f"callbacks.stability.init_loss.tolerance={tolerance} must be > 0 (nats)")
        self.tolerance = float(tolerance)

    def applies(self, trainer) -> bool:
        return getattr(trainer.lightning_module, "weights_from", None) is None

    def verdict(self, m, view: StepView) -> Verdict:
        self.next_step = math.inf  # judged once, on the fit's first measurement
        cfg = view.model_cfg  # its vocab_size and init
        vocab_size = getattr(cfg, "vocab_size", None)
        if m.step != 0 or not vocab_size or m.nonfinite:
            return OK
        expected = math.log(vocab_size)
        if abs(m.loss - expected) <= self.tolerance:
            return OK
        detail = {"loss": m.loss, "expected": expected, "tolerance": self.tolerance, "vocab_size": vocab_size}
        detail["init"] = getattr(cfg, "init", None)
        return Verdict("log", "init_loss", detail, onset=m.step)
