"""The Hydra callback that summarises a multirun; Hydra builds it for every run, so it loads `sweep.py` only then."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from steadylm.sweep import report

        report(Path(config.hydra.sweep.dir))
