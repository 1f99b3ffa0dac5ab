"""Print the text of one data window: `python -m steadylm.diagnose.window shard=PATH start=N end=M`.

`shard`, `start` and `end` are a row of `<run_dir>/stability/suspects.jsonl` (the shard's file name there is
relative to the run's `data.dir`: pass `data.dir=DIR shard=NAME`, or the full path as `shard`). Prints the
decoded `tokens[start:end]` of that shard, exactly what the model read.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from steadylm.cli import run_command
from steadylm.errors import SteadyError


def show(cfg: DictConfig) -> None:
    shard = Path(str(cfg.shard))
    if cfg.data.dir and not shard.is_absolute():
        shard = Path(cfg.data.dir) / shard
    if not shard.is_file():
        raise SteadyError(f"{shard}: shard file not found; pass the full path, or data.dir=<the run's data.dir>")
    if not isinstance(cfg.start, int) or not isinstance(cfg.end, int) or not 0 <= cfg.start < cfg.end:
        raise SteadyError(f"start={cfg.start!r} end={cfg.end!r}: token offsets must be whole numbers, 0 <= start < end")
    from steadylm.stability.suspects import window_text

    print(window_text(shard, cfg.start, cfg.end))


def main(argv: list[str] | None = None) -> None:
    run_command("window", __doc__, show, argv, prog="python -m steadylm.diagnose.window")


if __name__ == "__main__":
    main()
