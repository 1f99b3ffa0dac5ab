"""The end of a run a signal stopped (`steadylm.preemption`): the line that resumes it, the requeue, and exit 75,
`EX_TEMPFAIL`, which a scheduler can requeue on (failure is 1, bad input 2, divergence 3, a kill 128+N)."""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import OmegaConf

from steadylm.distributed import in_multirun, is_rank_zero_process
from steadylm.parallel import SLOT_ENV

log = logging.getLogger("steadylm")

PREEMPTED_EXIT = 75


def resume_command(output_dir: str, overrides: list[str], script: str) -> str:
    """The command that continues this run: the same overrides, the same run dir, `resume=auto`."""
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in ("resume", "ckpt_path", "hydra.run.dir")]
    return shlex.join(["python", script, *kept, f"hydra.run.dir={output_dir}", "resume=auto"])


def slurm_requeue_command(env: dict[str, str]) -> list[str] | None:
    """`scontrol requeue <job>` for this SLURM job (array tasks as JOB_TASK); None outside SLURM."""
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return ["scontrol", "requeue", f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"]
    return ["scontrol", "requeue", env["SLURM_JOB_ID"]] if env.get("SLURM_JOB_ID") else None


def requeue(record: dict[str, Any], env: dict[str, str]) -> str:
    """Ask SLURM to requeue this job when the signal was a pre-timeout one; a note for the user's line."""
    if record["requeue"] == "submitit":
        return "; submitit requeues the job, and it resumes by itself"
    if record["requeue"] != "scontrol" or (command := slurm_requeue_command(env)) is None:
        return ""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"; `{shlex.join(command)}` failed ({err}): resubmit the job yourself"
    if done.returncode:
        return f"; `{shlex.join(command)}` failed ({done.stderr.strip() or done.returncode}): resubmit it yourself"
    return f"; requeued SLURM job {command[-1]} (it resumes by itself with resume=auto)"


def finish_preempted(cfg, record: dict[str, Any], submitit_handler: Callable | None = None) -> None:
    """After result.json (`record`: the Preemption callback's, or what a sweep job's rank 0 wrote): one line, the
    requeue, exit 75. A multirun ends too (the signal was for the process), after the `on_multirun_end` of its
    `hydra.callbacks` (the sweep summary), which Hydra never reaches; the sweep of a job that submitit requeues, or of
    a parallel sweep's job, is summarised by its submitting process."""
    if is_rank_zero_process():
        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
        script = "train.py" if os.environ.get("SUBMITIT_EXECUTOR") else sys.argv[0] or "train.py"  # not submitit's
        command = resume_command(str(cfg.paths.output_dir), overrides, script)
        saved = f"state saved in {record['checkpoint']}" if record["checkpoint"] else "no new checkpoint"
        at = f" at step {record['step']}" if record["step"] is not None else ""
        line = f"preempted: {record['signal']}{at}, {saved}; resume with: {command}"
        print(line + requeue(record, dict(os.environ)), file=sys.stderr, flush=True)
        if in_multirun() and record["requeue"] != "submitit" and not os.environ.get(SLOT_ENV):
            config = OmegaConf.create({"hydra": OmegaConf.to_container(HydraConfig.get(), resolve=True)})
            for node in reversed(list((config.hydra.get("callbacks") or {}).values())):
                instantiate(node).on_multirun_end(config=config)
    if record["requeue"] == "submitit" and callable(submitit_handler):  # submitit's own handler requeues the job
        try:
            submitit_handler(signal.Signals[record["signal"]], None)
        except Exception as err:
            log.error("submitit did not requeue the job: %s", err)
    sys.exit(PREEMPTED_EXIT)
