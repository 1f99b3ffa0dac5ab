"""A run's outcome in `<run_dir>/result.json`, and the number `train.py` hands a Hydra sweeper.

`finish_job` runs at the end of every run (rank 0 writes) and classifies it: a run *diverged* when its loss
went non-finite, a stability callback stopped it (a non-finite streak or a spike past the rollback budget, or
a final loss far above the run's best: see `stability.recovery`), or its `train()` raised; a run that finished
is *unstable* when its events show persisting logit growth or a mitigation acting materially
(`stability.instability`), *preempted* when a signal stopped it, and *ok* otherwise. The sweep summary
(`sweep.py`, a tool the training path never imports) reads these files.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from steadylm.distributed import is_rank_zero_process
from steadylm.stability.events import stop_event
from steadylm.stability.instability import instability

RESULT_FILE = "result.json"
# What a sweep's best LR means beyond its own shape: the parametrisation and muP's base shape.
TRANSFER_KEYS = ("parametrization", "mup_base_width", "mup_base_head_dim", "mup_output_mult", "d_model", "pos")


def divergence(metrics: dict[str, float], run_dir: Path, error: BaseException | None) -> str | None:
    """Why a job diverged, or None when it did not."""
    if error is not None:
        return f"train() raised {type(error).__name__}: {error}"
    event = stop_event(run_dir)
    if event is not None:
        detail = event.get("detail") or {}
        kind = detail.get("kind") if event.get("kind") == "stop" and detail.get("kind") else event.get("kind")
        module = detail.get("module")
        if module:  # a non-finite streak: the module says it all
            return f"stopped on {kind} at step {event.get('step')}, first in {module}"
        return f"stopped on {kind} at step {event.get('step')}" + (
            f": {detail['reason']}" if detail.get("reason") else ""
        )
    for key in ("train/loss", "val/loss"):
        if key in metrics and not math.isfinite(metrics[key]):
            return f"non-finite {key}"
    return None


def finish_job(
    cfg: DictConfig,
    metrics: dict[str, float],
    error: BaseException | None = None,
    preempted: dict[str, Any] | None = None,
) -> tuple[float | None, str, str | None]:
    """Record the job's outcome (rank 0); return the metric a sweeper optimises (NaN when diverged), the status
    (ok | unstable | diverged | preempted) and its reason. An unstable job keeps its metric: it finished, its
    loss is real. A job stopped by a signal (`preempted`: the record of `steadylm.preemption`) is `preempted`,
    with the step and the checkpoint `resume=auto` continues from."""
    run_dir = Path(cfg.paths.output_dir)
    reason = divergence(metrics, run_dir, error)
    status = "diverged" if reason else "ok"
    if preempted:
        status, reason = "preempted", f"{preempted['signal']} at step {preempted['step']}"
    elif not reason and (reason := instability(run_dir, float(cfg.optim.lr))):
        status = "unstable"
    if is_rank_zero_process():
        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
        result = {
            "status": status,
            "reason": reason,
            **({"step": preempted["step"], "checkpoint": preempted["checkpoint"]} if preempted else {}),
            "lr": float(cfg.optim.lr),
            "val_loss": metrics.get("val/loss"),
            "train_loss": metrics.get("train/loss"),
            "overrides": overrides,
            "model": {
                **{k: cfg.model.get(k) for k in TRANSFER_KEYS},  # a null mup base is the model's own shape:
                "mup_base_width": cfg.model.get("mup_base_width") or cfg.model.d_model,
                "mup_base_head_dim": cfg.model.get("mup_base_head_dim") or cfg.model.d_model // cfg.model.n_head,
            },
        }
        run_dir.mkdir(parents=True, exist_ok=True)
        # json writes NaN/Infinity tokens, which json.loads reads back.
        (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
    metric = cfg.get("optimized_metric")
    if not metric:
        return None, status, reason
    return (float("nan") if status == "diverged" else metrics.get(metric)), status, reason
