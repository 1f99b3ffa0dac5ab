"""Export, the FLOP count and the memory estimate learn each `GPTConfig` switch from one declaration
(`model/switches.py`), and refuse in one line a switch they do not know: tested with a switch added here."""

from __future__ import annotations

from dataclasses import dataclass, fields

from steadylm import memory
from steadylm.config import compose
from steadylm.devices import Devices
from steadylm.errors import ConfigError
from steadylm.export import hf_family
from steadylm.model import GPT, GPTConfig
from steadylm.model.switches import SWITCHES, Switch

SMALL = dict(n_layer=1, n_head=2, d_model=32, context_length=16, vocab_size=64)


@dataclass
class WindowConfig(GPTConfig):
    """A fork's new switch: a sliding attention window (null: full causal attention)."""

    window: int | None = None


def test_every_field_is_declared_once_and_every_declaration_is_a_field():
    assert {f.name for f in fields(GPTConfig)} == set(SWITCHES)


def readers(cfg: GPTConfig, monkeypatch, tmp_path) -> dict:
    """What each reader makes of `cfg`: its answer, or the one line it refused with."""
    monkeypatch.setattr(memory, "GPTConfig", type(cfg))  # the model config class the estimate builds
    extra = [f"+model.{f.name}={'null' if getattr(cfg, f.name) is None else getattr(cfg, f.name)}" for f in
             fields(cfg) if f.name not in SWITCHES or f.name == "window"]  # fmt: skip
    run = compose(
        ["trainer=cpu", *[f"model.{k}={v}" for k, v in SMALL.items()], *extra, f"paths.output_dir={tmp_path}"]
    )
    answers = {}
    for name, read in (
        ("export", lambda: hf_family(cfg)),
        ("flops", lambda: GPT(cfg).flops_per_token()),
        ("memory", lambda: memory.plan(run, "32-true", Devices("cpu", 1, 1), run.data.batch_size).per_process),
    ):
        try:
            answers[name] = read()
        except ConfigError as err:
            assert "\n" not in str(err)
            answers[name] = str(err)
    return answers


def test_an_undeclared_switch_is_refused_by_every_reader(monkeypatch, tmp_path):
    got = readers(WindowConfig(**SMALL), monkeypatch, tmp_path)
    for reader, answer in got.items():
        assert answer.startswith("model.window is not declared in steadylm/model/switches.py, so "), reader
    assert "the FLOP count (GPT.flops_per_token" in got["flops"] and "export.py" in got["export"]


def test_a_declared_switch_is_refused_only_away_from_neutral_by_the_readers_that_do_not_know_it(monkeypatch, tmp_path):
    monkeypatch.setitem(SWITCHES, "window", Switch(None, None, "the same activations", neutral=None))
    plain = readers(GPTConfig(**SMALL), monkeypatch, tmp_path)
    assert readers(WindowConfig(**SMALL), monkeypatch, tmp_path) == plain  # off: as if the field did not exist
    windowed = readers(WindowConfig(**SMALL, window=8), monkeypatch, tmp_path)
    assert windowed["export"] == (
        "model.window=8 is not understood by the Hugging Face export (export.py); use model.window=null, "
        "or teach it and say how in SWITCHES (steadylm/model/switches.py)"
    )
    assert windowed["flops"].startswith("model.window=8 is not understood by the FLOP count")
    assert windowed["memory"] == plain["memory"]  # the estimate was told the window changes nothing it counts
    assert plain["export"] == "gpt2" and plain["flops"] > 0
