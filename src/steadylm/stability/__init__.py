"""The stability suite: one Lightning callback that detects, names and survives divergence.

`Stability` (`step.py`) owns each optimizer step's checks (`check.py`'s protocol); every detection and action
goes to `<run_dir>/stability/events.jsonl` (`events.py`).
"""

from steadylm.stability.events import emit, read_events, stop_event
from steadylm.stability.step import Stability

__all__ = ["Stability", "emit", "read_events", "stop_event"]
