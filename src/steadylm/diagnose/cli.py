"""The diagnose command: `python -m steadylm.diagnose RUN_DIR` writes RUN_DIR/report.md and prints its verdict."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from steadylm.diagnose.findings import analyse
from steadylm.diagnose.report import write_report
from steadylm.diagnose.runlog import load_run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m steadylm.diagnose", description=__doc__)
    parser.add_argument("run_dir", type=Path, help="a run folder (tensorboard/, stability/, checkpoints/)")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        print(f"error: {args.run_dir}: not a run folder; pass the run's output dir, e.g. logs/train/runs/<time>",
              file=sys.stderr)
        sys.exit(2)
    log = load_run(args.run_dir)
    diagnosis = analyse(log)
    report = write_report(log, diagnosis)
    p = diagnosis.primary
    print(f"onset step {p.onset}: {p.cause}: {p.summary} -> {p.fix}" if p else "no instability found")
    print(f"report: {report}")
