"""The stability suite: Lightning callbacks that detect, name and survive divergence.

Each is a callback with its own `state_dict`, on by default in `conf/callbacks/default.yaml` and
droppable from the command line (`~callbacks.spike`). They share one `StabilitySuite` (`suite.py`: the
per-step measurement of `probe.py`, the steps judged bad, the `Recovery` with its in-memory snapshots)
and write every detection and action to `<run_dir>/stability/events.jsonl` (`events.py`).
"""

from steadylm.stability.anomaly import AnomalyHooks, NonFiniteError
from steadylm.stability.events import emit, read_events, stop_event
from steadylm.stability.faults import FaultInjector
from steadylm.stability.guard import NonFiniteGuard
from steadylm.stability.loss_scale import LossScaleMonitor
from steadylm.stability.recovery import Recovery
from steadylm.stability.spike import SpikeDetector
from steadylm.stability.stats import GradParamStats
from steadylm.stability.suite import StabilitySuite, attach, suite_of

__all__ = [
    "AnomalyHooks",
    "FaultInjector",
    "GradParamStats",
    "LossScaleMonitor",
    "NonFiniteError",
    "NonFiniteGuard",
    "Recovery",
    "SpikeDetector",
    "StabilitySuite",
    "attach",
    "emit",
    "read_events",
    "stop_event",
    "suite_of",
]
