"""Every signal, metric and event kind the README and docs/stability.md name exists in a real run.

The metrics the precursor signals are computed from are logged by a short fit under the defaults; every event kind
in docs/stability.md's table (and each `stability/*` metric the pages name) comes out of a short real fit with the
switch or fault that provokes it. A kind that cannot happen on a CPU is listed with the reason.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from steadylm.stability import read_events
from steadylm.stability.check import Check
from steadylm.stability.events import ACTIONS
from steadylm.stability.verdict import OK
from steadylm.train import train
from tests.helpers import FAST, faults, scalars

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", ROOT / "docs" / "stability.md")
NOT_ON_A_CPU = {"fp16_skip_streak": "trainer.precision=16-mixed needs a CUDA GPU (a CPU runs it as bf16)"}
S = "callbacks.stability"
NAN = [{"kind": "nan_loss", "step": s} for s in (5, 6, 7)]  # three in a row: the guard rolls back
GROWTH = f"+{S}.checks.growth={{_target_: tests.test_documented_signals.Growth}}"
# Each fit, and the switches or faults that make it provoke what the docs name.
FITS = {
    "alarms": [f"{S}.init_loss.tolerance=0.001", f"{S}.stats.update_ratio_alarm=1e-9", f"{S}.stats.attn_logit_alarm=1e-9",
               f"{S}.spike.sigma=0.01", f"{S}.spike.grad_ratio=1.0", f"{S}.spike.warmup=4", f"{S}.spike.action=log",
               faults({"kind": "corrupt_labels", "step": 20})],
    "faults": [faults(*NAN, {"kind": "inf_grad", "step": 14, "param": "wte.weight"})],
    # a rollback two steps before the end, to weights 8 steps older: the run ends before its loss is back
    "cut_short": [f"{S}.recovery.every_n_steps=8", faults(*({"kind": "nan_loss", "step": s} for s in (21, 22, 23)))],
    "stop": [f"{S}.guard.action=stop", faults(*NAN)],
    "qk_clip": [f"{S}.qk_clip.tau=0.001", f"{S}.qk_clip.backoff_after=2"],
    "signals": ["model.qk_norm=true", f"{S}.signals.log_z=1.0", GROWTH, f"{S}.signals.forecast_lr=0.7",
                f"+{S}.signals.watch.growth={{value: growth.value, level: 100.0}}"],
}  # fmt: skip


class Growth(Check):
    """A value that doubles every 3 steps: the signals forecast it, as they would a growing residual stream."""

    def measure(self, view):
        return {"value": ("max", torch.tensor(2.0 ** (view.step / 3)))}

    def verdict(self, m, view):
        return OK


def documented_kinds() -> set[str]:
    """The event kinds in docs/stability.md's table (its last column; the actions and detail keys left out)."""
    text = (ROOT / "docs" / "stability.md").read_text()
    table = text.split("## What happens by default", 1)[1].split("\n\n", 2)[1]
    cells = [row.split("|")[3] for row in table.splitlines()[2:]]
    words = {w for cell in cells for w in re.findall(r"`([a-z0-9_]+)(?::[^`]*)?`", cell)}
    return words - (set(ACTIONS) - {"rollback", "stop"}) - {"strikes", "lr_scale", "reason", "cause"}


def documented_metrics() -> set[str]:
    return {m for p in PAGES for m in re.findall(r"`(stability/[a-z_]+(?:/<[a-z]+>)?)`", p.read_text())}


def test_the_signals_metrics_are_logged_under_the_defaults(make_cfg, tmp_path):
    train(make_cfg("trainer.max_steps=20"))
    tags = set(scalars(tmp_path / "run"))
    per_block = ("act_rms", "max_attn_logit", "grad_norm", "param_norm", "update_ratio")
    expected = {"stability/log_z", "stability/update_ratio"} | {
        f"stability/{k}/block_{i}" for k in per_block for i in (0, 1)
    }
    assert expected <= tags, sorted(expected - tags)


def test_every_documented_event_kind_and_metric_comes_out_of_a_real_fit(make_cfg, tmp_path):
    kinds, tags = set(), set()
    for name, overrides in FITS.items():
        out = tmp_path / name
        train(make_cfg(*FAST, "trainer.max_steps=24", *overrides, out=out))
        kinds |= {e["kind"] for e in read_events(out)}
        tags |= set(scalars(out))
    missing = documented_kinds() - kinds - set(NOT_ON_A_CPU)
    assert not missing, f"documented, never produced: {sorted(missing)} (produced: {sorted(kinds)})"
    assert {"nonfinite_loss", "lr_backoff", "forecast", "init_loss"} <= documented_kinds()  # the parse found them
    metrics = {m.replace("<signal>", "growth") for m in documented_metrics()}
    assert metrics and not metrics - tags, sorted(metrics - tags)
