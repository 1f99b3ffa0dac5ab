"""Errors a user can cause: one sentence naming the file or key and the fix.

Entry points catch `SteadyError`, print its message and exit non-zero, so a user never
reads a traceback through Lightning internals for a mistake in their own input.
"""


class SteadyError(Exception):
    """A problem with the user's input (config, data, checkpoint, environment)."""


class ConfigError(SteadyError):
    """A config that would train wrongly (e.g. two different context lengths)."""


class DataError(SteadyError):
    """A shard or input file that cannot be used; the message names the file."""
