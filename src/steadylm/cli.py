"""One command-line style for every steadylm command: Hydra `key=value` overrides composed from `conf/`.

Each command has its own config in `conf/` (`doctor.yaml`, `prepare.yaml`, `generate.yaml`, `export.yaml`,
`diagnose.yaml`): the training config where the command needs it, plus the command's own keys at the top
level (`???` marks a required one). `--help` lists those keys with their defaults. Every mistake a user
can make on the line (an unknown key, a bad value, a missing required key, a `SteadyError` from the
command itself) is one `error:` line and exit 2; the command never sees a half-parsed config.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from omegaconf import DictConfig, OmegaConf

from steadylm.errors import SteadyError, exit_with

HELP_FLAGS = ("-h", "--help")


def own_keys(name: str) -> dict:
    """The command's own top-level keys and their defaults, as written in `conf/<name>.yaml`."""
    from steadylm.config import CONF_DIR

    raw = OmegaConf.to_container(OmegaConf.load(CONF_DIR / f"{name}.yaml"), resolve=False)  # "???" kept as written
    raw.pop("defaults", None)

    def flat(node: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in node.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    return flat(raw)


def usage(name: str, summary: str, prog: str) -> str:
    from steadylm.config import CONF_DIR

    lines = [f"usage: {prog} key=value ...", "", summary.strip(), "", "keys (default):"]
    for key, value in own_keys(name).items():
        shown = "required" if value == "???" else repr(value)
        lines.append(f"  {key:<18} {shown}")
    if "train" in OmegaConf.load(CONF_DIR / f"{name}.yaml").get("defaults", []):
        lines.append("  plus every train.py key: model=..., data.*, trainer.*, optim.* (python train.py --help)")
    return "\n".join(lines)


def compose_command(name: str, overrides: list[str], prog: str | None = None) -> DictConfig:
    """The command's config with the overrides applied; Hydra's errors become one-line `SteadyError`s."""
    from hydra.errors import HydraException
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    from steadylm.config import compose, hydra_error_message

    try:
        cfg = compose(overrides, config_name=name)
        for key, default in own_keys(name).items():
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            if default == "???" and OmegaConf.is_missing(node, leaf):
                raise SteadyError(f"{key}= is required; see {prog or 'python -m steadylm.' + name} --help")
            check_type(key, default, node[leaf])
    except (HydraException, OmegaConfBaseException) as err:
        if isinstance(err, MissingMandatoryValue):
            raise SteadyError(
                f"{err.full_key}= is required; see {prog or 'python -m steadylm.' + name} --help"
            ) from None
        raise SteadyError(hydra_error_message(err)) from None
    return cfg


KINDS = ((bool, "true or false"), (int, "a whole number"), (float, "a number"))


def check_type(key: str, default, value) -> None:
    """A command key takes the kind of value its default is (null is always allowed: "not set")."""
    for kind, words in KINDS:
        if isinstance(default, kind) and value is not None:
            ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
            if kind is float:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok:
                raise SteadyError(f"{key}={value!r} is not allowed; it must be {words}")
            return


def run_command(
    name: str,
    summary: str,
    task: Callable[[DictConfig], int | None],
    argv: list[str] | None = None,
    prog: str | None = None,
    positional: str | None = None,
) -> None:
    """Parse, compose, run `task(cfg)`; exit with its return code (0 when None), or 2 on a user's mistake.

    `positional`: the key a lone argument without `=` sets (`python -m steadylm.diagnose RUN_DIR` = `run=RUN_DIR`).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or f"python -m steadylm.{name}"
    if any(a in HELP_FLAGS for a in argv):
        print(usage(name, summary, prog))
        return
    if positional and argv and "=" not in argv[0]:
        argv[0] = f"{positional}={argv[0]}"
    try:
        code = task(compose_command(name, argv, prog))
    except SteadyError as err:
        exit_with(err)
    if code:
        sys.exit(code)
