"""The values a run resolved, in `<run_dir>/config.yaml`: what every tool that reads a run folder reads.

Hydra's `.hydra/config.yaml` holds the config as composed, interpolations and all (`optim.lr` is
`${lr_rule:...}`, `paths.output_dir` is `${hydra:...}`), which only a running Hydra app can resolve. Rank 0 writes
the resolved config beside it when training starts (the same dict every checkpoint carries), so diagnose, doctor and
the sweep summary read numbers, never expressions, whatever resolvers the run used."""

from __future__ import annotations

from pathlib import Path

import yaml

RUN_CONFIG = "config.yaml"


def write_run_config(run_dir: str | Path, config: dict) -> None:
    path = Path(run_dir) / RUN_CONFIG
    header = (
        "# The values this run resolved (what diagnose and the other tools read); .hydra/ has the composed config\n"
    )
    path.write_text(header + yaml.safe_dump(config, sort_keys=False))


def read_run_config(run_dir: str | Path) -> dict | None:
    """The run's resolved config: `config.yaml`, else the newest readable checkpoint's copy; None when neither."""
    run_dir = Path(run_dir)
    if (path := run_dir / RUN_CONFIG).is_file():
        return yaml.safe_load(path.read_text())
    from steadylm.checkpointing import SHARDED_META, CheckpointError, safe_load

    for ckpt in sorted((run_dir / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:  # a distributed checkpoint's (a folder's) config is in its meta.pt: no shard is read
            return safe_load(ckpt / SHARDED_META if ckpt.is_dir() else ckpt, mmap=True)["steadylm"]["config"]
        except (CheckpointError, KeyError, TypeError):
            continue
    return None
