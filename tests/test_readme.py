"""Every command the README shows is checked against the code: a stale preset, key or target fails here.

`python train.py ...` and `python -m steadylm.<command> ...` lines are composed with their exact overrides
(Hydra's parser, the command's own config and `validate_config`; a sweep's values one by one); `make`
lines must name a target `make -n` accepts. What each command does end to end is tested beside its code.
"""

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from steadylm.cli import compose_command
from steadylm.config import compose, set_key, validate_config
from steadylm.resolve import fill_derived

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
COMMANDS = {
    "doctor": "doctor",
    "diagnose": "diagnose",
    "generate": "generate",
    "export": "export",
    "data.prepare": "prepare",
    "eval": "eval",
}


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def split_sweep(overrides: list[str]) -> list[list[str]]:
    """`optim.lr=1e-4,3e-4` -> one override list per value (what `-m` runs)."""
    jobs = [[]]
    for o in overrides:
        key, _, value = o.partition("=")
        values = value.split(",") if "," in value and not value.startswith(("[", "{", "'", '"')) else [value]
        jobs = [job + [f"{key}={v}"] for job in jobs for v in values]
    return jobs


def test_the_readme_shows_commands_for_every_entry_point():
    commands = readme_commands()
    assert any(c.startswith("make demo") for c in commands) and any(c.startswith("make test") for c in commands)
    shown = {c.split()[2] for c in commands if c.startswith("python -m steadylm.")}
    assert {f"steadylm.{name}" for name in COMMANDS} <= shown


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_is_valid(command, tmp_path, monkeypatch):
    monkeypatch.setenv("STEADYLM_ROOT", str(tmp_path))
    words = shlex.split(command)
    if words[0] == "make":
        proc = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return
    assert words[0] == "python", command
    if words[1] == "train.py":
        overrides = [w for w in words[2:] if w != "-m"]
        for job in split_sweep(overrides):
            cfg = compose([*job, f"paths.output_dir={tmp_path}"])
            if cfg.model.vocab_size is None:  # startup takes it from the shards, which this test has none of
                set_key(cfg, "model.vocab_size", 320)
            fill_derived(cfg)
            validate_config(cfg)
        return
    assert words[1] == "-m" and words[2].startswith("steadylm."), command
    name = COMMANDS[words[2].removeprefix("steadylm.")]
    args = words[3:]
    if name == "diagnose" and args and "=" not in args[0]:
        args = [f"run={args[0]}", *args[1:]]
    compose_command(name, args)
