"""Errors a user can cause: one sentence naming the file or key and the fix, printed (no traceback), exit non-zero."""

import sys


class SteadyError(Exception):
    """A problem with the user's input (config, data, checkpoint, environment)."""


class ConfigError(SteadyError):
    """A config that would train wrongly (e.g. two different context lengths)."""


class DataError(SteadyError):
    """A shard or input file that cannot be used; the message names the file."""


def one_line(err: BaseException) -> str:
    """The user's one line for an error: ours as written, even when torch re-raised it from a DataLoader worker
    ("Caught DataError in DataLoader worker process 0. Original Traceback ... DataError: <msg>": only <msg>)."""
    text = str(err).strip()
    if text.startswith("Caught ") and "Original Traceback" in text:
        last = text.splitlines()[-1]
        text = last.split(": ", 1)[1] if ": " in last else last
    return " ".join(text.split())


def exit_with(err: BaseException, code: int = 2) -> None:
    """Print `error: <one line>` on stderr and exit: how every entry point reports a user's mistake."""
    print(f"error: {one_line(err)}", file=sys.stderr)
    sys.exit(code)
