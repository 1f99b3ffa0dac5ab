"""muP (`model.parametrization=mup`): the multipliers, the LR groups, the coordinate check, training, export, sweeps."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from steadylm.checkpointing import safe_load
from steadylm.config import compose, set_key, validate_config
from steadylm.doctor.check import FAIL, OK
from steadylm.doctor.coord_check import FLAT, check_coords, coord_check
from steadylm.errors import ConfigError
from steadylm.export import sp_state_dict
from steadylm.model import GPT, GPTConfig
from steadylm.model.mup import attn_scale, logit_mult, param_groups, width_mult
from steadylm.module import LMModule
from steadylm.resolve import fill_derived
from steadylm.result import divergence, finish_job
from steadylm.schedule import Schedule, set_lr
from steadylm.sweep import summarize_sweep
from steadylm.train import train
from tests.helpers import run_cli

LLAMA = dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2)
FAMILIES = {"gpt2": {}, "llama": LLAMA, "llama-qk_norm": {**LLAMA, "qk_norm": True}}


def net(seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, n_head=4, vocab_size=320, context_length=32, **kw))


def ids(n: int = 3, T: int = 32) -> torch.Tensor:
    return torch.randint(0, 320, (n, T), generator=torch.Generator().manual_seed(0))


def perturb(model: torch.nn.Module) -> None:
    """Trained-looking weights: norm gains and biases away from 1 and 0, so a wrong fold shows."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("family", FAMILIES)
def test_mup_at_its_base_shape_is_sp_bit_for_bit(family):
    kw = dict(d_model=128, mup_base_width=128, mup_base_head_dim=32, **FAMILIES[family])
    sp, mup = net(**kw), net(parametrization="mup", **kw)
    assert all(torch.equal(a, b) for a, b in zip(sp.state_dict().values(), mup.state_dict().values()))
    with torch.no_grad():
        assert torch.equal(sp(ids()), mup(ids()))
    groups = param_groups(mup.named_parameters(), mup.cfg, lr=1e-3, weight_decay=0.1)
    assert [(g["lr"], g["lr_mult"]) for g in groups] == [(1e-3, 1.0)] * 3
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0, 0.1]


def test_mup_multipliers_at_four_times_the_base():
    m = net(d_model=128, parametrization="mup", mup_base_width=32, mup_base_head_dim=8)
    assert m.logit_mult == 0.25
    assert net(d_model=128, parametrization="mup", mup_base_width=32, mup_output_mult=2.0).logit_mult == 0.5
    assert net(d_model=128, mup_base_width=32, mup_output_mult=2.0).logit_mult == 1.0  # sp ignores the mup keys
    assert m.blocks[0].attn.scale == pytest.approx(math.sqrt(8) / 32)  # 1/d_head, = 1/sqrt(8) at d_head 8
    # init: hidden std 0.02/sqrt(4), residual writers also / sqrt(2 n_layer); embeddings unchanged
    assert m.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.01, rel=0.05)
    assert m.blocks[0].mlp.proj.weight.std().item() == pytest.approx(0.01 / 2, rel=0.05)
    assert m.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    x = ids()
    with torch.no_grad():
        h = m.wte(x) + m.wpe(torch.arange(x.shape[1]))
        for b in m.blocks:
            h = b(h)
        torch.testing.assert_close(m(x), m.lm_head(m.ln_f(h)) * 0.25, rtol=0, atol=0)


def test_lmmodule_groups_scale_hidden_lr_and_keep_lr_times_wd():
    model = dict(
        n_layer=2, n_head=4, d_model=128, vocab_size=320, context_length=32, tie_embeddings=False,
        parametrization="mup", mup_base_width=32, mup_base_head_dim=8,
    )  # fmt: skip
    optim = dict(lr=1e-2, min_lr=1e-3, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8, warmup_steps=2, total_steps=10)
    module = LMModule(model=model, optim=optim)
    opt = module.configure_optimizers()
    names = {id(p): n for n, p in module.named_parameters()}
    by_name = {g["name"]: g for g in opt.param_groups}
    assert list(by_name) == ["embeddings", "vectors", "hidden"]
    assert {names[id(p)] for p in by_name["embeddings"]["params"]} == {
        "net.wte.weight",
        "net.wpe.weight",
        "net.lm_head.weight",
    }
    hidden = {names[id(p)].split(".", 3)[-1] for p in by_name["hidden"]["params"]}
    assert hidden == {"attn.qkv.weight", "attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight"}
    assert all(p.dim() == 1 for p in by_name["vectors"]["params"]) and by_name["vectors"]["weight_decay"] == 0.0
    assert (by_name["hidden"]["lr_mult"], by_name["hidden"]["weight_decay"]) == (0.25, 0.4)
    set_lr(opt, Schedule(lr=1e-2, min_lr=1e-3, warmup_steps=2, total_steps=10)(3))  # each group keeps its lr_mult
    lrs = [g["lr"] for g in opt.param_groups]
    assert lrs[0] == lrs[1] and lrs[2] == pytest.approx(lrs[0] / 4) and lrs[0] < 1e-2
    # decoupled decay shrinks by lr * wd per step: the same for hidden and embedding matrices
    assert lrs[2] * by_name["hidden"]["weight_decay"] == pytest.approx(lrs[0] * 0.1)


def startup_config(overrides: list[str]):
    """The config as startup validates it: the null keys filled (the vocabulary as the bytes shards would give)."""
    cfg = compose(overrides)
    if cfg.model.vocab_size is None:
        set_key(cfg, "model.vocab_size", 320)
    fill_derived(cfg)
    return cfg


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.parametrization=mu"], "model.parametrization='mu' is not allowed; use one of: sp, mup"),
        (["model.parametrization=mup", "model.mup_base_head_dim=24"], "model.mup_base_head_dim=24 does not divide"),
        (["model.parametrization=mup", "model.mup_base_width=0"], "model.mup_base_width=0 must be a whole number > 0"),
        (["model.parametrization=mup", "model.mup_base_width=100000"], "outside [1/64, 1024]"),
        (["model.parametrization=mup", "model.mup_base_width=64", "model.init=xavier"], "needs model.init=gpt2 off"),
        (["model.mup_output_mult=0"], "model.mup_output_mult=0 must be a number > 0"),
    ],
)
def test_bad_mup_values_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate_config(startup_config(overrides))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_cli_refuses_an_unknown_parametrization_in_one_line_exit_2(tmp_path):
    proc = run_cli("model.parametrization=mupp", "model.vocab_size=320", cwd=tmp_path)  # no shards needed
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["error: model.parametrization='mupp' is not allowed; use one of: sp, mup"], proc.stderr[-2000:]


# --- the coordinate check ---------------------------------------------------------------------------


def tokens() -> torch.Tensor:
    """Four windows of 33 byte ids from a stdlib source file: the embedded corpus's kind of text."""
    data = Path(json.__file__).read_bytes()[: 4 * 33]
    return torch.tensor(list(data)).view(4, 33)


def no_lr_scaling(named, cfg, lr, weight_decay):
    """A deliberately wrong muP: every multiplier but the hidden matrices' 1/width_mult LR."""
    return [{**g, "lr": lr, "lr_mult": 1.0} for g in param_groups(named, cfg, lr, weight_decay)]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_coord_check_is_flat_under_mup_grows_under_sp_and_catches_missing_lr_scaling(family):
    model = {"vocab_size": 320, "n_head": 4, **FAMILIES[family]}
    mup = coord_check(model, tokens(), "mup")
    sp = coord_check(model, tokens(), "sp")
    broken = coord_check(model, tokens(), "mup", groups=no_lr_scaling)
    assert mup.flat and abs(mup.worst[1]) < FLAT / 2, mup.slopes
    assert not sp.flat and sp.slopes["Δblocks.1"] > 1.0, sp.slopes  # Adam in sp: updates grow ~ width^2
    assert not broken.flat and broken.slopes["Δblocks.1"] > 1.0, broken.slopes


def test_doctor_row_passes_mup_fails_the_broken_variant_and_shows_sp_growing():
    cfg = compose(["model.parametrization=mup", "model.vocab_size=320"])
    batch = (tokens()[:, :-1], tokens()[:, 1:])
    ok = check_coords(cfg, batch)[0]
    assert ok.status == OK and ok.evidence.startswith("mup flat in width") and "widths 64/128/256" in ok.evidence
    bad = check_coords(cfg, batch, groups=no_lr_scaling)[0]
    assert bad.status == FAIL and "mup is not width-independent" in bad.evidence and "model/mup.py" in bad.fix
    sp = check_coords(compose(["model.vocab_size=320", "model.parametrization=sp"]), batch)[0]
    assert sp.status == OK and sp.evidence.startswith("sp (grows with width")


# --- export: the multipliers folded into the weights --------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_folded_weights_give_an_sp_model_the_same_logits(family):
    kw = dict(d_model=128, mup_base_width=32, mup_base_head_dim=8, **FAMILIES[family])
    mup = net(parametrization="mup", **kw)
    perturb(mup)
    sp = net(**kw)
    sp.load_state_dict(sp_state_dict(mup))
    with torch.no_grad():
        torch.testing.assert_close(sp(ids()), mup(ids()), rtol=0, atol=1e-5)
        assert (sp(ids()) - net(**kw)(ids())).abs().max() > 1e-2  # the fold moved the weights for real


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_mup_model_matches_ours_in_transformers(family):
    pytest.importorskip("transformers")
    from steadylm.export import to_hf_model

    kw = dict(d_model=64, mup_base_width=16, mup_base_head_dim=4, mup_output_mult=3.0, **FAMILIES[family])
    ours = net(parametrization="mup", **kw)
    perturb(ours)
    hf = to_hf_model(ours, eos_id=256)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids()).logits, ours(ids()), rtol=0, atol=1e-4)


# --- a real run, resume, and the sweep summary ----------------------------------------------------------

MUP = ["model.parametrization=mup", "model.mup_base_width=32", "model.mup_base_head_dim=16"]  # d 64 = 2x


@pytest.mark.slow
def test_mup_trains_under_the_stability_suite_and_resumes_bitwise(make_cfg, tmp_path):
    common = [*MUP, "optim.total_steps=16", "trainer.log_every_n_steps=1", "callbacks.checkpoint.every_n_train_steps=8"]
    common.append("optim.lr=3e-3")  # 16 steps learn a nat at this LR
    full, split = tmp_path / "full", tmp_path / "split"
    cfg = make_cfg(*common, "trainer.max_steps=16", out=full)
    metrics, _ = train(cfg)
    assert divergence(metrics, full) is None  # the stability suite stopped nothing
    finish_job(cfg, metrics)  # what a sweep job records for its summary
    recorded = json.loads((full / "result.json").read_text())["model"]
    assert recorded == dict(
        parametrization="mup", mup_base_width=32, mup_base_head_dim=16, mup_output_mult=1.0, d_model=64, pos="learned"
    )
    assert metrics["train/loss"] < math.log(257) - 1.0  # it learned (byte-level: from ~ln 257)
    train(make_cfg(*common, "trainer.max_steps=8", out=split))
    train(make_cfg(*common, "trainer.max_steps=16", "resume=auto", out=split))
    a, b = safe_load(full / "checkpoints" / "last.ckpt"), safe_load(split / "checkpoints" / "last.ckpt")
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    groups = a["optimizer_states"][0]["param_groups"]
    assert [(g["name"], g["lr_mult"], g["weight_decay"]) for g in groups] == [
        ("embeddings", 1.0, 0.1),
        ("vectors", 1.0, 0.0),
        ("hidden", 0.5, 0.2),
    ]
    assert groups[2]["lr"] == pytest.approx(groups[0]["lr"] / 2)


def write_result(sweep, num: int, lr: float, val_loss: float, model: dict) -> None:
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(f"- optim.lr={lr}\n")
    result = dict(status="ok", reason=None, lr=lr, val_loss=val_loss, overrides=[f"optim.lr={lr}"], model=model)
    (job / "result.json").write_text(json.dumps(result))


def test_mup_sweep_summary_gives_the_command_that_trains_the_bigger_preset(tmp_path):
    model = dict(
        parametrization="mup", mup_base_width=128, mup_base_head_dim=32, mup_output_mult=1.0, d_model=128, pos="learned"
    )
    for i, (lr, loss) in enumerate([(1e-3, 2.6), (4e-3, 2.3), (1.6e-2, 2.5)]):
        write_result(tmp_path / "mup", i, lr, loss, model)
        write_result(tmp_path / "sp", i, lr, loss, {**model, "parametrization": "sp"})
    summarize_sweep(tmp_path / "mup")
    text = (tmp_path / "mup" / "summary.md").read_text()
    command = "python train.py model=small model.parametrization=mup model.mup_base_width=128 model.mup_base_head_dim=32 optim.lr=0.004"
    assert "**Best LR: 0.004** (job 1, val/loss 2.3)" in text and command in text
    assert validate_config(startup_config(command.split()[2:])) is None  # the command composes and validates
    assert OmegaConf.select(compose(command.split()[2:]), "model.d_model") == 768
    write_result(tmp_path / "alpha", 0, 4e-3, 2.3, {**model, "mup_output_mult": 4.0, "pos": "rope"})
    summarize_sweep(tmp_path / "alpha")
    text = (tmp_path / "alpha" / "summary.md").read_text()
    assert (
        "model=llama_small model.parametrization=mup model.mup_base_width=128 model.mup_base_head_dim=32 model.mup_output_mult=4 optim.lr=0.004"
        in text
    )
    summarize_sweep(tmp_path / "sp")
    text = (tmp_path / "sp" / "summary.md").read_text()
    assert "**Best LR: 0.004**" in text and "Under sp it holds at this width only" in text and "model=small" not in text


@pytest.mark.parametrize("preset", ["tiny", "llama_tiny", "small", "llama_1b"])
def test_mup_is_every_presets_switch_based_at_tiny_and_muon_is_accepted_with_it(preset):
    """sp is the default (muP ends above sp's best at width: docs/model.md); the switch keeps tiny's base."""
    vocab = ["model.vocab_size=320"] if preset in ("tiny", "llama_tiny") else []  # from the shards otherwise
    assert compose([f"model={preset}", *vocab]).model.parametrization == "sp"
    cfg = compose([f"model={preset}", "model.parametrization=mup", "optim=muon", "optim.warmup_steps=100", *vocab])
    validate_config(cfg)  # mup + Muon: accepted
    assert (cfg.model.parametrization, cfg.model.mup_base_width, cfg.model.mup_base_head_dim) == ("mup", 128, 32)


@pytest.mark.parametrize("override", ["model.d_model=512", "model.n_head=8", "model.n_layer=4"])
def test_a_shape_override_keeps_tinys_base(override):
    """Widening tiny keeps muP based at 128/32, so its LR carries; at tiny's own shape every multiplier is 1."""
    mup = ["model.vocab_size=320", "model.parametrization=mup"]
    model = lambda *o: GPTConfig(**OmegaConf.to_container(compose([*mup, *o]).model))  # noqa: E731
    cfg = model(override)
    assert (cfg.mup_base_width, cfg.mup_base_head_dim) == (128, 32)
    assert width_mult(cfg) == (4.0 if override == "model.d_model=512" else 1.0)
    at_base = model()
    assert (width_mult(at_base), logit_mult(at_base), attn_scale(at_base)) == (1.0, 1.0, 1 / math.sqrt(32))
    sp = compose(["experiment=gpt2_124m"]).model
    assert sp.parametrization == "sp"  # the nanoGPT / llm.c reproduction keeps their parametrisation and LR
