"""One command-line style: every command takes Hydra `key=value` overrides, lists its keys with `--help`,
and answers a mistyped key or a missing required one with one `error:` line and exit 2."""

import importlib

import pytest

COMMANDS = {  # module -> (a key --help must list, a required key or None)
    "steadylm.data.prepare": ("data.shard_tokens", None),
    "steadylm.doctor": ("deep", None),
    "steadylm.diagnose": ("run", "run"),
    "steadylm.diagnose.window": ("shard", "shard"),
    "steadylm.generate": ("max_new_tokens", "ckpt"),
    "steadylm.export": ("out", "ckpt"),
}


def run(module: str, argv: list[str]) -> int:
    main = importlib.import_module(module if module != "steadylm.diagnose" else "steadylm.diagnose.cli").main
    try:
        main(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


@pytest.mark.parametrize("module", list(COMMANDS))
def test_help_lists_the_commands_keys(module, capsys):
    assert run(module, ["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m {module} key=value") and "keys (default):" in out
    assert COMMANDS[module][0] in out


@pytest.mark.parametrize("module", list(COMMANDS))
def test_a_mistyped_key_is_one_line_and_exit_2(module, capsys):
    assert run(module, ["no_such_key=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("error: no_such_key is not a config key"), err


@pytest.mark.parametrize("module", [m for m, (_, required) in COMMANDS.items() if required])
def test_a_missing_required_key_is_one_line_and_exit_2(module, capsys):
    assert run(module, []) == 2
    err = capsys.readouterr().err.strip().splitlines()
    required = COMMANDS[module][1]
    assert len(err) == 1 and err[0].startswith(f"error: {required}= is required; see python -m {module} --help"), err
