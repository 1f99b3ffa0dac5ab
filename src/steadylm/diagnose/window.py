"""Print the text of one data window: `python -m steadylm.diagnose.window shard=PATH start=N end=M`.

`shard`, `start` and `end` are a row of `<run_dir>/stability/suspects.jsonl` (the shard's file name there is
relative to the run's `data.dir`: pass `data.dir=DIR shard=NAME`, or the full path as `shard`). Prints the
decoded `tokens[start:end]` of that shard, exactly what the model read.
"""

from __future__ import annotations

import sys
from pathlib import Path

USAGE = "usage: python -m steadylm.diagnose.window shard=PATH start=N end=M [data.dir=DIR]"


def main(argv: list[str] | None = None) -> None:
    args = {}
    for a in sys.argv[1:] if argv is None else argv:
        key, sep, value = a.partition("=")
        if not sep:
            print(f"error: {a!r} is not key=value\n{USAGE}", file=sys.stderr)
            sys.exit(2)
        args[key] = value
    missing = [k for k in ("shard", "start", "end") if k not in args]
    if missing:
        print(f"error: missing {', '.join(missing)}\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    shard = Path(args["shard"])
    if "data.dir" in args and not shard.is_absolute():
        shard = Path(args["data.dir"]) / shard
    if not shard.is_file():
        print(f"error: {shard}: shard file not found; pass the full path, or data.dir=<the run's data.dir>", file=sys.stderr)
        sys.exit(2)
    try:
        start, end = int(args["start"]), int(args["end"])
    except ValueError:
        print(f"error: start and end must be integers\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    from steadylm.stability.suspects import window_text

    print(window_text(shard, start, end))


if __name__ == "__main__":
    main()
