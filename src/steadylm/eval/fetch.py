"""`python -m steadylm.eval.fetch hellaswag [out=DIR]`: download a standard multiple-choice set as it ships.

The file lands in `out` (default `data/eval/`) under its published name, ready for `callbacks.eval.tasks` and
`python -m steadylm.eval`. Where the network is unreachable it says so in one line and writes nothing.
"""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

from steadylm.errors import SteadyError

SETS = {  # name -> the published file (the authors' own copy, the one build-nanogpt and lm-eval's source read)
    "hellaswag": "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl",
}


def fetch(task: str, out: str | Path, timeout: float = 30.0) -> Path:
    if task not in SETS:
        raise SteadyError(f"task={task!r} is not one this command fetches; use one of: {', '.join(SETS)}")
    url = SETS[task]
    dest = Path(out) / url.rsplit("/", 1)[1]
    if dest.is_file():
        return dest
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            data = resp.read()
    except OSError as err:
        reason = getattr(err, "reason", err)
        raise SteadyError(f"cannot download {url} ({reason}); copy the file to {dest} by hand") from None
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.replace(dest)
    return dest


def main(argv: list[str] | None = None) -> None:
    from steadylm.cli import run_command

    def task(cfg) -> None:
        dest = fetch(cfg.task, cfg.out)
        print(f"{cfg.task}: {dest} (callbacks.eval.tasks=[{dest}])", file=sys.stdout)

    run_command(
        "eval_fetch", __doc__.split("\n\n")[0], task, argv, prog="python -m steadylm.eval.fetch", positional="task"
    )


if __name__ == "__main__":
    main()
