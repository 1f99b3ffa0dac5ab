"""The stability suite: Lightning callbacks that detect, name and survive divergence.

Each is a callback with its own `state_dict`, on by default in `conf/callbacks/default.yaml` and
droppable from the command line (`~callbacks.spike`). All read one shared per-step measurement
(`probe.py`) and write every detection and action to `<run_dir>/stability/events.jsonl`.
"""

from steadylm.stability.anomaly import AnomalyHooks, NonFiniteError
from steadylm.stability.events import emit, read_events
from steadylm.stability.faults import FaultInjector
from steadylm.stability.guard import NonFiniteGuard
from steadylm.stability.loss_scale import LossScaleMonitor
from steadylm.stability.spike import SpikeDetector
from steadylm.stability.stats import GradParamStats

__all__ = [
    "AnomalyHooks", "FaultInjector", "GradParamStats", "LossScaleMonitor", "NonFiniteError", "NonFiniteGuard",
    "SpikeDetector", "emit", "read_events",
]
