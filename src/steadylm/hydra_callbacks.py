"""`SweepSummary`, the Hydra callback (`hydra.callbacks.sweep_summary`) that summarises a sweep once every job
has finished. Hydra builds it for every run, so it is apart from the summary itself (`sweep.py`, a tool), which
it loads only when a multirun ends: a single run never imports the tool."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from steadylm.sweep import report

        report(Path(config.hydra.sweep.dir))
