"""Preflight checks with the same overrides as `train.py`; `deep=true` rescans every token id, `lr_probe=false`
skips the short training runs of the LR-stability probe.

Exit 0 when nothing fails, 1 when a check fails, 2 when the overrides themselves cannot be composed.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from steadylm.cli import run_command
from steadylm.config import set_key
from steadylm.doctor.check import FAIL, Check, guarded, render_markdown, render_text
from steadylm.errors import SteadyError, one_line
from steadylm.resolve import fill, fill_derived

# The rows whose FAIL leaves the probe nothing sound to train: a config train.py would refuse, data it cannot
# read, a model that does not build or run. Any other FAIL (the coordinate check, memory, the schedule's plot)
# is a verdict on a model that trains, and the probe's evidence belongs beside it.
PROBE_NEEDS = ("config:", "data:", "model: build", "model: finite forward/backward")


def run_checks(cfg: DictConfig, *, out_dir: Path, deep: bool = False) -> list[Check]:
    # Imported here so a mistyped override is reported before torch and Lightning load.
    from steadylm.doctor.config_checks import check_schedule, config_checks
    from steadylm.doctor.data_checks import check_shards, data_checks
    from steadylm.doctor.lr_probe import check_lr_probe
    from steadylm.doctor.model_checks import model_checks

    if cfg.model.get("init_from") is not None:  # a key set against its shape: the user's mistake, one line, exit 2
        from steadylm.model.hf import pretrained_shape

        fill(cfg, pretrained_shape(cfg))
    try:
        fill_derived(cfg)  # null vocab, tokenizer and warmup as training fills them, before any row reads them
    except SteadyError as err:  # no data to take the vocabulary from: nothing else can be built
        fix = "prepare the data (python -m steadylm.data.prepare data.dir=...) or fix the data.* keys, or set model.vocab_size"
        return [
            Check("data: vocabulary from the data", FAIL, one_line(err), fix),
            *guarded("data: shards", lambda: check_shards(cfg, deep)),
        ]
    rows = config_checks(cfg)
    data_rows, batch = data_checks(cfg, deep)
    rows += data_rows
    rows += guarded("model: build", lambda: model_checks(cfg, batch))
    rows += guarded("schedule: LR curve", lambda: check_schedule(cfg, out_dir / "lr_schedule.png"))
    if cfg.get("lr_probe", False) and not any(r.failed for r in rows if r.name.startswith(PROBE_NEEDS)):
        rows += guarded("lr probe: stability at x1, x3, x10", lambda: check_lr_probe(cfg))
    return rows


def doctor(cfg: DictConfig) -> int:
    out = Path(cfg.out) if cfg.out else Path(cfg.paths.log_dir) / "doctor"
    set_key(cfg, "paths.output_dir", str(out))
    rows = run_checks(cfg, out_dir=out, deep=bool(cfg.deep))
    out.mkdir(parents=True, exist_ok=True)
    (out / "doctor.md").write_text("# steadylm doctor\n\n" + render_markdown(rows))
    print(render_text(rows))
    failed = [r for r in rows if r.failed]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} checks passed; table and LR plot in {out}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> None:
    run_command("doctor", __doc__, doctor, argv)
