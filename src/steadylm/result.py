"""A run's outcome in `<run_dir>/result.json` (rank 0 writes it, or a sweep job's process; `sweep.py` reads it) and the
number `train.py` hands a Hydra sweeper. A run *diverged* when its loss went non-finite or a stability callback stopped
it (`stability.recovery`); a sweep job *failed* when it raised, a user's mistake stopped it, or one of its processes
died (the reason: the first failing rank's own error); a run that finished is *unstable* when its events show
persisting logit growth or a mitigation acting materially (`stability.instability`), *preempted* when a signal
stopped it, and *ok* otherwise."""

from __future__ import annotations

import json
import math
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from steadylm.distributed import is_rank_zero_process
from steadylm.errors import is_int
from steadylm.stability.events import stop_event
from steadylm.stability.instability import config_checks, instability

RESULT_FILE = "result.json"
# What a sweep's best LR means beyond its own shape: the parametrisation and muP's base shape.
TRANSFER_KEYS = ("parametrization", "mup_base_width", "mup_base_head_dim", "mup_output_mult", "d_model", "pos")


def divergence(metrics: dict[str, float], run_dir: Path) -> str | None:
    """Why a job diverged, or None when it did not."""
    if (event := stop_event(run_dir)) is not None:
        detail = event.get("detail") or {}
        kind = (event.get("kind") == "stop" and detail.get("kind")) or event.get("kind")
        module, why = detail.get("module"), detail.get("reason")  # a non-finite streak: the module says it all
        why = f", first in {module}" if module else f": {why}" if why else ""
        return f"stopped on {kind} at step {event.get('step')}{why}"
    for key in ("train/loss", "val/loss"):
        if key in metrics and not math.isfinite(metrics[key]):
            return f"non-finite {key}"
    return None


def val_loss_by_source(metrics: dict[str, float]) -> dict[str, float]:
    """`data.sources`: each source's `val/loss/<name>`, by name (empty for one source)."""
    return {k[len("val/loss/") :]: v for k, v in sorted(metrics.items()) if k.startswith("val/loss/")}


def finish_job(
    cfg: DictConfig, metrics: dict[str, float], failed: str | None = None, preempted: dict | None = None
) -> tuple[float | None, str, str | None]:
    """Record the job's outcome (rank 0; `failed`: why a sweep job failed; `preempted`: the Preemption callback's
    record); return the metric a sweeper optimises (NaN when diverged or failed: an unstable job keeps its metric,
    its loss is real), the status and its reason."""
    run_dir, model = Path(cfg.paths.output_dir), cfg.model
    lr = OmegaConf.select(cfg, "optim.lr", throw_on_resolution_failure=False)  # a failed job's may be no number
    lr = float(lr) if is_int(lr) or isinstance(lr, float) else None
    reason = failed or divergence(metrics, run_dir)
    status = "failed" if failed else "diverged" if reason else "ok"
    if preempted:
        at = f"at step {preempted['step']}" if preempted["step"] is not None else "before training"
        status, reason = "preempted", f"{preempted['signal']} {at}"
    elif not reason and (reason := instability(run_dir, lr, config_checks(cfg))):
        status = "unstable"
    if is_rank_zero_process():
        result = {
            "status": status,
            "reason": reason,
            **({k: preempted[k] for k in ("step", "checkpoint", "signal", "requeue")} if preempted else {}),
            "lr": lr,
            "val_loss": metrics.get("val/loss"),
            **({"val_loss_by_source": by_source} if (by_source := val_loss_by_source(metrics)) else {}),
            "train_loss": metrics.get("train/loss"),
            "overrides": list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else [],
            "model": {
                **{k: model.get(k) for k in TRANSFER_KEYS},  # a null mup base is the model's own shape:
                "mup_base_width": model.get("mup_base_width") or model.d_model,
                "mup_base_head_dim": model.get("mup_base_head_dim") or model.d_model // model.n_head,
            },
        }
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")  # NaN tokens json.loads reads back
    metric = cfg.get("optimized_metric")
    value = None if not metric else float("nan") if status in ("diverged", "failed") else metrics.get(metric)
    return value, status, reason
