"""`train(cfg) -> (metrics, objects)`: build everything from the composed config and fit (tests call it with a
composed config); `main` is the `@hydra.main` wrapper that turns a user's mistake into one line and an exit code."""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext, suppress
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig

from steadylm.config import CONF_DIR, hydra_errors_as_messages, plain_config
from steadylm.console import copy_console, quiet
from steadylm.derived import val_check_batches
from steadylm.distributed import in_multirun, is_job_rank, is_rank_zero_process
from steadylm.errors import ConfigError, SteadyError, exit_with
from steadylm.module import LMModule
from steadylm.preemption import Preempted, Preemption, place_last
from steadylm.progress import ProgressLines
from steadylm.resolve import Resolved, resolve
from steadylm.result import finish_job
from steadylm.run_config import write_run_config
from steadylm.stability.events import start_events


def instantiate_named(group: DictConfig | None, key: str) -> list[Any]:
    """Callbacks/loggers are named dict entries so `~callbacks.x` drops one; null entries are skipped."""
    entries = [(name, node) for name, node in (group or {}).items() if node is not None]
    if missing := [name for name, node in entries if "_target_" not in node]:  # settings for an absent entry
        raise ConfigError(
            f"{key}.{missing[0]} has no _target_, so nothing would run it: set keys of an existing entry "
            f"(e.g. callbacks.stability.{missing[0]}.*) or give it a _target_"
        )
    try:
        return [instantiate(node) for _, node in entries]
    except InstantiationException as err:
        if isinstance(err.__cause__, SteadyError):  # a callback refused its settings: that message, not Hydra's wrapper
            raise err.__cause__ from None
        raise


def build(cfg: DictConfig) -> dict[str, Any]:
    """Resolve `cfg` (resolve.py, before any process group or logger exists), then build the module and Trainer."""
    quiet()
    run = resolve(cfg)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # TF32 on Ampere+, as nanoGPT
    L.seed_everything(cfg.seed, workers=True)
    dm = run.datamodule
    data = {"tokenizer": dm.tokenizer_name, "val_bytes_per_token": dm.bytes_per_token}
    data["doc_separator"] = getattr(dm, "document_separator", None)  # data.pack=doc; a source without it: none
    data["val_sources"] = getattr(dm, "val_sources", None)  # data.sources: a val loader per source
    data["run_config"] = plain_config(cfg)  # every checkpoint carries it; rank 0 writes it to the run folder too
    module = LMModule(model=cfg.model, optim=cfg.optim, compile=cfg.compile, **data)
    return {"cfg": cfg, "run": run, "datamodule": dm, "module": module, "trainer": build_trainer(run)}


def build_trainer(run: Resolved) -> L.Trainer:
    cfg = run.cfg  # its own function: the benchmarks build a Trainer per round from one resolved run
    callbacks = place_last(instantiate_named(cfg.get("callbacks"), "callbacks"), f"{cfg.paths.output_dir}/checkpoints")
    if cfg.trainer.get("enable_progress_bar", True) and not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks.append(ProgressLines())  # one plain line per logging step (progress.py)
    loggers = instantiate_named(cfg.get("logger"), "logger") or False
    resolved = {"accelerator": run.devices.accelerator, "precision": run.precision}  # what memory was checked for
    resolved |= val_check_batches(cfg.trainer)
    return instantiate(cfg.trainer, callbacks=callbacks, logger=loggers, **resolved)


def train(cfg: DictConfig) -> tuple[dict[str, float], dict[str, Any]]:
    objects = build(cfg)
    trainer = objects["trainer"]
    ckpt_path = None
    if any(cfg.get(k) is not None for k in ("ckpt_path", "resume", "init_from")) or os.environ.get("SUBMITIT_EXECUTOR"):
        from steadylm.resume import checkpoint_to_resume  # loaded only by a run that may start from a checkpoint

        ckpt_path = checkpoint_to_resume(cfg, objects["module"])
    if trainer.is_global_zero:
        start_events(trainer)  # the events log exists from the start, empty while nothing happened
        write_run_config(cfg.paths.output_dir, objects["module"].run_config)
    with suppress(Preempted, SIGTERMException):  # a signal stopped every rank: see the Preemption callback
        trainer.fit(objects["module"], datamodule=objects["datamodule"], ckpt_path=ckpt_path, weights_only=True)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}, objects


_task_started = [False]


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def _app(cfg: DictConfig) -> float | None:
    _task_started[0] = True
    if in_multirun():  # a sweep job's own process (jobs.py, loaded only then): it may start the job's ranks
        from steadylm.jobs import run_job

        return run_job(cfg, train_and_record)
    return train_and_record(cfg)


def train_and_record(cfg: DictConfig) -> float | None:
    """Train, write result.json, end as the outcome says. In a sweep job's process a failure is that job's `failed`
    row and the sweep goes on; a sweep job's rank raises, for its job's process to record (jobs.py)."""
    run = cfg.paths.output_dir
    with copy_console(Path(run) / "train.log") if is_rank_zero_process() else nullcontext():
        try:
            metrics, objects = train(cfg)
        except Exception as err:
            if in_multirun():  # one job of a sweep: its `failed` row, and the sweep goes on (jobs.py)
                from steadylm.jobs import failed_here

                return failed_here(cfg, err)
            if isinstance(err, SteadyError):
                exit_with(err)
            raise
        preemption = next(c for c in objects["trainer"].callbacks if isinstance(c, Preemption))
        value, status, reason = finish_job(cfg, metrics, preempted=preemption.record)
        if preemption.record and not is_job_rank():  # a signal stopped the run: requeue.py, loaded only then, exits 75
            from steadylm.requeue import finish_preempted

            finish_preempted(cfg, preemption.record, preemption.previous.get(preemption.submitit))
        if status == "unstable":  # finished and usable, so exit 0; result.json says `unstable` (docs/stability.md)
            print(f"warning: training was unstable: {reason}; see {run}/stability/events.jsonl", file=sys.stderr)
        if status == "diverged" and not (in_multirun() or is_job_rank()):
            see = f"see {run}/stability/events.jsonl or `python -m steadylm.diagnose {run}`"
            print(f"error: training diverged ({reason}); {see}", file=sys.stderr)
            sys.exit(3)
        return value


def main() -> None:
    """`python train.py ...`: Hydra's own errors (unknown preset, typo'd key) also become one line."""
    if is_job_rank():  # a rank that a sweep job's process started (jobs.py, loaded only then)
        from steadylm.jobs import as_rank

        return as_rank(_main)
    _main()


def _main() -> None:
    _task_started[0] = False
    with hydra_errors_as_messages(_task_started):
        _app()


if __name__ == "__main__":
    main()
