"""What the console shows: the third-party messages steadylm silences, each with the reason a user cannot act on it
(anything else still shows), and the copy of a run's console in `<run>/train.log`."""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

# (warning category, message start as a regex), each with why nobody running steadylm can act on it
SILENCED_WARNINGS = (
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),  # Lightning's pytree helper, torch >= 2.10
    (UserWarning, r"Precision .* is not supported by the model summary"),  # bf16-mixed; steadylm estimates memory
    # steadylm resumes mid-epoch exactly (its sampler state is in the checkpoint), which Lightning cannot see
    (UserWarning, r"You're resuming from a checkpoint that ended before the epoch ended"),
    # the val metrics are summed over ranks before they are logged (LMModule.val_results), which Lightning cannot see
    (UserWarning, r"It is recommended to use `self.log\('val/"),
)
# (logger, message start, why)
SILENCED_LOGS = (("lightning.pytorch.utilities.rank_zero", "💡 Tip: For seamless cloud logging", "a logger's ad"),)


def _keep(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(tuple(start for _, start, _ in SILENCED_LOGS))


def quiet() -> None:
    """Install the filters above (idempotent: `addFilter` never adds the same filter twice)."""
    for category, message in SILENCED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, _start, _why in SILENCED_LOGS:
        logging.getLogger(name).addFilter(_keep)


class _Tee:
    """A text stream that writes to the console stream and a file; everything else is the console's."""

    def __init__(self, console: TextIO, file: TextIO) -> None:
        self.console, self.file = console, file

    def write(self, text: str) -> int:
        self.file.write(text)
        return self.console.write(text)

    def __getattr__(self, name: str):
        return getattr(self.console, name)


@contextmanager
def copy_console(path: Path) -> Iterator[None]:
    """Everything printed to stdout/stderr (logging handlers too) also goes to `path`; none for an unwritable folder
    (the run's own check names the key and exits 2)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        file = path.open("a", encoding="utf-8", buffering=1)  # line-buffered: each line is on disk at once
    except OSError:
        yield
        return
    with file:
        streams = (sys.stdout, sys.stderr)
        tees = {id(s): _Tee(s, file) for s in streams}
        loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        handlers = [h for lg in loggers if isinstance(lg, logging.Logger) for h in lg.handlers]
        sys.stdout, sys.stderr = (tees[id(s)] for s in streams)
        streaming = [h for h in handlers if isinstance(h, logging.StreamHandler) and id(h.stream) in tees]
        bound = [(h, h.setStream(tees[id(h.stream)])) for h in streaming]  # setStream returns the old stream
        try:
            yield
        finally:
            sys.stdout, sys.stderr = streams
            for h, stream in bound:
                h.setStream(stream)
