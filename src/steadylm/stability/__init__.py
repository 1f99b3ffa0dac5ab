"""The stability suite: one Lightning callback that detects, names and survives divergence.

`Stability` (`step.py`) owns each optimizer step's checks; read its `step` method for the order. The
checks are plain classes with their own `state_dict` (`guard.py`, `spike.py`, `loss_scale.py`, `stats.py`,
`recovery.py`), each tunable or removable from the command line (`callbacks.stability.spike=null`).
Every detection and action goes to `<run_dir>/stability/events.jsonl` (`events.py`). `faults.py` breaks a run
on purpose (the divergence presets name `steadylm.stability.faults.FaultInjector`), so a plain run never loads it;
`anomaly.py` is `debug=anomaly`'s, loaded only by that preset.
"""

from steadylm.stability.events import emit, read_events, stop_event
from steadylm.stability.step import Stability

__all__ = ["Stability", "emit", "read_events", "stop_event"]
