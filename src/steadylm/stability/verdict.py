"""`Verdict`: what a check concludes about one step's measurement; the owner (`step.py`) applies it."""

from __future__ import annotations

from dataclasses import dataclass, field

ACTIONS = ("ok", "log", "backoff", "skip", "rollback", "stop")  # in rising severity


@dataclass(frozen=True)
class Verdict:
    action: str = "ok"  # one of ACTIONS
    kind: str | None = None  # the event kind written for it (None: nothing to write)
    detail: dict = field(default_factory=dict)  # the event's evidence
    onset: int | None = None  # rollback: the first bad step (restore a state from before it)
    reason: str = ""  # stop: why, in one sentence
    suspect: bool = False  # the measured step itself was abnormal (its snapshot is not known-good)
    context: dict = field(default_factory=dict, compare=False, repr=False)  # for the owner only (batches, ...)
    metrics: dict = field(default_factory=dict, compare=False)  # scalars for the loggers, at step `onset`

    def __post_init__(self) -> None:
        assert self.action in ACTIONS, self.action


OK = Verdict()
