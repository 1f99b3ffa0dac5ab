"""Refuse, before anything is written, a run that cannot work on this machine, with one message.

Two kinds of mistakes are caught here: the environment (more GPUs asked for than are visible, an
output folder that cannot be written) and the command line itself (an unknown preset, a typo'd key,
a run folder Hydra cannot create), which Hydra would otherwise report as a multi-line dump or a
traceback. It must never change the config or touch files other than its own probe file.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf

from steadylm.errors import ConfigError
from steadylm.memory import check_fits
from steadylm.precision import resolve_precision

GPU_ACCELERATORS = ("gpu", "cuda")


def requested_devices(devices) -> int | None:
    """How many devices `trainer.devices` asks for, or None when Lightning picks (`auto`, -1)."""
    if isinstance(devices, int) or (isinstance(devices, str) and devices.strip().isdigit()):
        n = int(devices)
        return None if n == -1 else n
    if isinstance(devices, (list, tuple)) or OmegaConf.is_list(devices):
        return len(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    return None


def uses_gpu(cfg: DictConfig) -> bool:
    return str(cfg.trainer.accelerator) in ("auto", *GPU_ACCELERATORS) and torch.cuda.is_available()


def check_devices(cfg: DictConfig) -> None:
    """More devices than GPUs is refused, unless the user chose the CPU on purpose (`trainer.accelerator=cpu`):
    with `auto`, Lightning would quietly start that many CPU processes instead."""
    accelerator = str(cfg.trainer.accelerator)
    if accelerator == "cpu":
        return
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    wanted = requested_devices(cfg.trainer.devices)
    if accelerator in GPU_ACCELERATORS and available == 0:
        raise ConfigError(
            f"trainer.accelerator={accelerator} but no CUDA GPU is visible on this machine; "
            "use trainer=cpu (or trainer.accelerator=auto)"
        )
    if wanted is not None and wanted > max(available, 1):
        raise ConfigError(
            f"trainer.devices={cfg.trainer.devices} asks for {wanted} GPUs but {available} "
            f"{'is' if available == 1 else 'are'} visible on this machine; set trainer.devices={max(available, 1)} "
            f"or fewer, or trainer.accelerator=cpu to run {wanted} CPU processes on purpose"
        )


def check_precision_supported(cfg: DictConfig) -> None:
    """fp16 with a loss scaler runs on CUDA only: on a CPU Lightning would quietly train in bf16 instead."""
    precision, accelerator = str(cfg.trainer.precision), str(cfg.trainer.accelerator)
    on_cuda = accelerator in ("auto", *GPU_ACCELERATORS) and torch.cuda.is_available()
    if precision in ("16-mixed", "16") and not on_cuda:
        raise ConfigError(
            f"trainer.precision={precision} (fp16 with a loss scaler) needs a CUDA GPU and none is in use here "
            f"(trainer.accelerator={accelerator}); use trainer.precision=bf16-mixed or 32-true"
        )


def check_writable(folder: Path, key: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".steadylm-probe-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"{key}={folder} is not writable ({e.strerror or e}); point it (or hydra.run.dir) at a folder you can write"
        ) from None


def check_environment(cfg: DictConfig) -> None:
    check_devices(cfg)
    check_precision_supported(cfg)
    check_fits(cfg, str(resolve_precision(cfg.trainer.precision, cfg.trainer.accelerator)), uses_gpu(cfg))
    check_writable(Path(cfg.paths.output_dir), "paths.output_dir")


# --- the command line --------------------------------------------------------------------------


def _struct_key_message(err: HydraException) -> str | None:
    """`trainer.max_stepz=3` -> name the key, the closest real keys, and the `+` escape hatch."""
    cause = err.__cause__
    full_key = getattr(cause, "full_key", None)
    if not full_key:
        return None
    parent = getattr(cause, "parent_node", None)
    known = list(parent.keys()) if isinstance(parent, DictConfig) else []
    leaf = full_key.rsplit(".", 1)[-1]
    prefix = full_key[: -len(leaf)]
    close = difflib.get_close_matches(leaf, [str(k) for k in known], n=2)
    hint = f"did you mean {' or '.join(prefix + c for c in close)}? " if close else ""
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
    """Turn Hydra's composition/run-folder errors into `error: <one line>` and exit 2.

    Hydra only lets such errors escape (instead of printing its own dump) when HYDRA_FULL_ERROR is
    set, so it is set for the call; a user who set it themselves gets Hydra's full traceback.
    `started[0]` is flipped by the task once it runs, so errors from training are never relabelled.
    """
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
