"""`SweepSummary`, the Hydra callback (`hydra.callbacks.sweep_summary`) that summarises a multirun when it ends.
Hydra builds it for every run, so it loads the summary (`sweep.py`, a tool) only then: a single run never imports it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from steadylm.sweep import report

        report(Path(config.hydra.sweep.dir))
