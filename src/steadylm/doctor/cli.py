"""The doctor command: compose the config exactly as `train.py` would, run every check, print the table.

Exit 0 when nothing fails, 1 when a check fails, 2 when the overrides themselves cannot be composed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omegaconf import DictConfig

from steadylm.config import compose, set_key
from steadylm.doctor.check import Check, guarded, render_markdown, render_text


def run_checks(cfg: DictConfig, *, out_dir: Path, deep: bool = False) -> list[Check]:
    # Imported here so a mistyped override is reported before torch and Lightning load.
    from steadylm.doctor.config_checks import check_schedule, config_checks
    from steadylm.doctor.data_checks import data_checks
    from steadylm.doctor.model_checks import model_checks

    rows = config_checks(cfg)
    data_rows, batch = data_checks(cfg, deep)
    rows += data_rows
    rows += guarded("model: build", lambda: model_checks(cfg, batch))
    rows += guarded("schedule: LR curve", lambda: check_schedule(cfg, out_dir / "lr_schedule.png"))
    return rows


def one_line(err: BaseException) -> str:
    """Hydra's multi-line composition errors as one line (options listed, search path dropped)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    if "Available options" in " ".join(lines):
        head = lines[0]
        i = next(i for i, ln in enumerate(lines) if ln.startswith("Available options"))
        options = [ln for ln in lines[i + 1:] if not ln.startswith(("Config search path", "provider="))]
        return f"{head}; available: {', '.join(options)}"
    return "; ".join(ln.rstrip(".") for ln in lines[:2] if not ln.startswith("See https"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m steadylm.doctor", description="Preflight checks; takes the same overrides as train.py."
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=small data.batch_size=8")
    parser.add_argument("--deep", action="store_true", help="rescan every token id in every shard (slow on big data)")
    parser.add_argument("--out", type=Path, default=None, help="where the table and LR plot go (default: logs/doctor)")
    args = parser.parse_intermixed_args(argv)
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = compose(args.overrides)
        out = args.out or Path(cfg.paths.log_dir) / "doctor"
        set_key(cfg, "paths.output_dir", str(out))
    except (HydraException, OmegaConfBaseException) as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        sys.exit(2)
    rows = run_checks(cfg, out_dir=out, deep=args.deep)
    out.mkdir(parents=True, exist_ok=True)
    (out / "doctor.md").write_text("# steadylm doctor\n\n" + render_markdown(rows))
    print(render_text(rows))
    failed = [r for r in rows if r.failed]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} checks passed; table and LR plot in {out}")
    sys.exit(1 if failed else 0)
