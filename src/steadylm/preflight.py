"""Refuse, before anything is written and with one line, a run this machine cannot run, and a command line
Hydra would answer with a dump or a traceback (an unknown preset, a typo'd key, a run folder it cannot create).
"""

from __future__ import annotations

import contextlib
import difflib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig

from steadylm.devices import Devices
from steadylm.errors import ConfigError
from steadylm.memory import MemoryPlan, check_fits


def check_environment(cfg: DictConfig, devices: Devices, precision: str) -> MemoryPlan:
    """Refuse what Lightning would run quietly otherwise (`auto` devices without a GPU: CPU processes; fp16 off CUDA:
    bf16), a run that does not fit, an output folder that cannot be written; the memory plan that fits."""
    n, accelerator, fp = devices.per_node, cfg.trainer.accelerator, str(cfg.trainer.precision)
    if str(accelerator) == "auto" and devices.accelerator == "cpu" and n > 1:
        raise ConfigError(
            f"trainer.devices={cfg.trainer.devices} asks for {n} GPUs but 0 are visible on this machine; "
            f"set trainer.devices=1, or trainer.accelerator=cpu to run {n} CPU processes on purpose"
        )
    if fp in ("16-mixed", "16") and not devices.on_cuda:
        raise ConfigError(
            f"trainer.precision={fp} (fp16 with a loss scaler) needs a CUDA GPU and none is in use here "
            f"(trainer.accelerator={accelerator}); use trainer.precision=bf16-mixed or 32-true"
        )
    memory = check_fits(cfg, precision, devices)
    folder = Path(cfg.paths.output_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".steadylm-probe-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"paths.output_dir={folder} is not writable ({e.strerror or e}); "
            "point it (or hydra.run.dir) at a folder you can write"
        ) from None
    return memory


def _struct_key_message(err: HydraException) -> str | None:
    """`trainer.max_stepz=3` -> name the key, the closest real keys, and the `+` escape hatch."""
    full_key, parent = getattr(err.__cause__, "full_key", None), getattr(err.__cause__, "parent_node", None)
    if not full_key:
        return None
    known = list(parent.keys()) if isinstance(parent, DictConfig) else []
    leaf = full_key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, [str(k) for k in known], n=2)
    hint = f"did you mean {' or '.join(full_key[: -len(leaf)] + c for c in close)}? " if close else ""
    return f"{full_key} is not a config key; {hint}(to add a new key on purpose, write +{full_key}=...)"


def hydra_error_message(err: Exception) -> str:
    """One line for an error Hydra raised while composing the config or creating the run folder."""
    if isinstance(err, MissingConfigException) and err.options:
        first = str(err).splitlines()[0].removeprefix("In 'train': ")
        return f"{first}; available: {', '.join(err.options)} (see conf/)"
    if isinstance(err, HydraException):
        return _struct_key_message(err) or " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    if isinstance(err, OSError):
        where = err.filename or "the run folder"
        return f"cannot create {where} ({err.strerror or err}); pass hydra.run.dir=<a folder you can write>"
    return str(err)


@contextlib.contextmanager
def hydra_errors_as_messages(started: list[bool]) -> Iterator[None]:
    """Hydra's composition/run-folder errors as `error: <one line>`, exit 2: they escape only under HYDRA_FULL_ERROR
    (set for the call unless the user set it); `started[0]`, set once the task runs, keeps training's errors as is."""
    if os.environ.get("HYDRA_FULL_ERROR"):
        yield
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    except (HydraException, OSError) as err:
        if started[0]:
            raise
        print(f"error: {hydra_error_message(err)}", file=sys.stderr)
        sys.exit(2)
    finally:
        os.environ.pop("HYDRA_FULL_ERROR", None)
