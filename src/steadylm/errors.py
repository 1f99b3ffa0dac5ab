"""Errors a user can cause: one sentence naming the file or key and the fix, printed (no traceback), exit non-zero."""

import json
import os
import sys
import time

# Type checks for values as written: a bool is no number, and `number` is NaN (failing every comparison) for a non-number.
is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
number = lambda v: float(v) if is_int(v) or isinstance(v, float) else float("nan")


class SteadyError(Exception):
    """A problem with the user's input (config, data, checkpoint, environment)."""


class ConfigError(SteadyError):
    """A config that would train wrongly (e.g. two different context lengths)."""


class DataError(SteadyError):
    """A shard or input file that cannot be used; the message names the file."""


def one_line(err: BaseException) -> str:
    """Ours as written, also re-raised by a DataLoader worker ("Caught ... Original Traceback ... DataError: <msg>")."""
    text = str(err).strip()
    if text.startswith("Caught ") and "Original Traceback" in text:
        text = text.splitlines()[-1].split(": ", 1)[-1]
    return " ".join(text.split())


def exit_with(err: BaseException) -> None:
    """`error: <one line>` on stderr, exit 2: how every entry point reports a user's mistake. Under torch's elastic
    launcher (torchrun, a sweep job's ranks) the line also goes to this rank's error file: the launcher reports it."""
    line = f"error: {one_line(err)}"
    print(line, file=sys.stderr)
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with open(path, "w") as f:  # the format torch's ProcessFailure reads
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    sys.exit(2)
