"""Explain a run: `python -m steadylm.diagnose RUN_DIR` writes RUN_DIR/report.md and prints its verdict."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from steadylm.cli import run_command
from steadylm.diagnose.findings import analyse
from steadylm.diagnose.report import write_report
from steadylm.diagnose.runlog import load_run
from steadylm.errors import SteadyError


def diagnose(cfg: DictConfig) -> None:
    run_dir = Path(cfg.run)
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        what = "an empty folder" if run_dir.is_dir() else "not a folder"
        raise SteadyError(f"{run_dir}: {what}, not a run; pass the run's output dir, e.g. logs/train/runs/<time>")
    log = load_run(run_dir)
    diagnosis = analyse(log)
    report = write_report(log, diagnosis)
    p = diagnosis.primary
    print(f"onset step {p.onset}: {p.cause}: {p.summary} -> {p.fix}" if p else "no instability found")
    print(f"report: {report}")


def main(argv: list[str] | None = None) -> None:
    run_command("diagnose", __doc__, diagnose, argv, positional="run")
