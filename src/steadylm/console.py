"""What the console shows: the third-party messages steadylm silences, each with the reason a user cannot act
on it (anything else still shows), and the copy of a run's console in `<run>/train.log`.
"""

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
    # Lightning's own pytree helper under torch >= 2.10; fixed in Lightning, not in user code
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    # the summary's size column under bf16-mixed; the memory estimate at startup is steadylm's number
    (UserWarning, r"Precision .* is not supported by the model summary"),
    # steadylm resumes mid-epoch exactly (its sampler state is in the checkpoint), which Lightning cannot see
    (UserWarning, r"You're resuming from a checkpoint that ended before the epoch ended"),
)
# (logger, message start, why)
SILENCED_LOGS = (("lightning.pytorch.utilities.rank_zero", "💡 Tip: For seamless cloud logging", "a logger's ad"),)


class _DropMessages(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def quiet() -> None:
    """Install the filters above (idempotent: the same filter is never added twice)."""
    for category, message in SILENCED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, start, _why in SILENCED_LOGS:
        logger = logging.getLogger(name)
        if not any(getattr(f, "start", None) == start for f in logger.filters):
            logger.addFilter(_DropMessages(start))


class _Tee:
    """A text stream that writes to the console stream and a file; everything else is the console's."""

    def __init__(self, console: TextIO, file: TextIO) -> None:
        self.console, self.file = console, file

    def write(self, text: str) -> int:
        self.file.write(text)
        self.file.flush()
        return self.console.write(text)

    def flush(self) -> None:
        self.console.flush()
        self.file.flush()

    def __getattr__(self, name: str):
        return getattr(self.console, name)


@contextmanager
def copy_console(path: Path) -> Iterator[None]:
    """Everything printed to stdout/stderr (logging handlers too) also goes to `path`; none for an unwritable folder
    (the run's own check names the key and exits 2)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        file = path.open("a", encoding="utf-8")
    except OSError:
        yield
        return
    with file:
        streams = (sys.stdout, sys.stderr)
        tees = {id(s): _Tee(s, file) for s in streams}
        loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        handlers = [h for logger in loggers if isinstance(logger, logging.Logger) for h in logger.handlers]
        bound = [(h, h.stream) for h in handlers if isinstance(h, logging.StreamHandler) and id(h.stream) in tees]
        sys.stdout, sys.stderr = (tees[id(s)] for s in streams)
        for h, stream in bound:
            h.setStream(tees[id(stream)])
        try:
            yield
        finally:
            sys.stdout, sys.stderr = streams
            for h, stream in bound:
                h.setStream(stream)
