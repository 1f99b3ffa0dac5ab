"""optim=muon: which parameters get Muon, the device-side skip, bitwise resume, a fault survived, the tools."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys

import lightning as L
import pytest
import torch

from steadylm.checkpointing import safe_load
from steadylm.diagnose.cli import main as diagnose_main
from steadylm.doctor import run_checks
from steadylm.doctor.check import FAIL
from steadylm.export import main as export_main
from steadylm.generate import main as generate_main
from steadylm.model import GPT, GPTConfig
from steadylm.muon import NS_SCHEDULES, Muon, _iterate, _iterate_gram, ns_schedule, orthogonalize, param_groups
from steadylm.stability import read_events
from steadylm.train import build, train
from tests.helpers import CLI_TINY, DDP_TWO_CPU, ROOT, faults, run_cli

MUON = {"lr_mult": 1.0, "adjust_lr": "match_rms_adamw", "momentum": 0.95, "nesterov": True, "ns_steps": 5}
OPTIM = {"lr": 3e-3, "weight_decay": 0.1, "muon": MUON}


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=4, d_model=32, context_length=16, vocab_size=64, **kw))


def muon_opt(net: GPT, fused: bool = True) -> Muon:
    return Muon(param_groups(net, OPTIM), lr=OPTIM["lr"], fused=fused, ns_dtype="float32")


def backward(net: GPT, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 64, (4, 16), generator=g)
    net(idx).logsumexp(-1).mean().backward()


@pytest.mark.parametrize(
    "kw", [{}, {"mlp": "swiglu", "n_kv_head": 2, "pos": "rope", "norm": "rmsnorm", "tie_embeddings": False}]
)
def test_muon_takes_exactly_the_blocks_matrices_with_fused_projections_split(kw):
    net = tiny(**kw)
    groups = param_groups(net, OPTIM)
    names = {id(p): n for n, p in net.named_parameters()}
    muon = {names[id(p)]: rows for g in groups if g["muon"] for p, rows in zip(g["params"], g["splits"])}
    adam = {names[id(p)] for g in groups if not g["muon"] for p in g["params"]}
    assert set(muon) == {n for n, p in net.named_parameters() if n.startswith("blocks.") and p.dim() == 2}
    assert set(muon) | adam == set(names.values()) and not set(muon) & adam  # every parameter once
    assert "wte.weight" in adam and all(n in adam for n in names.values() if "ln" in n or n.endswith("bias"))
    q, kv = 32, 32 * net.cfg.n_kv_head // 4
    assert muon["blocks.0.attn.qkv.weight"] == (q, kv, kv)
    assert muon["blocks.1.mlp.fc.weight"] == ((net.cfg.hidden,) * 2 if kw else None)
    assert muon["blocks.0.attn.proj.weight"] is None
    if kw:
        assert "lm_head.weight" in adam  # untied: the output head stays on AdamW


def test_under_mup_muon_groups_take_no_width_factor_and_a_wide_mup_model_learns():
    """The Muon groups' LR needs no width rule under mup (measured: mup.py); the rest is muP's own."""
    mup = {"parametrization": "mup", "mup_base_width": 32, "mup_base_head_dim": 8}
    at_base = [(g["muon"], g["lr"], g["lr_mult"], g["weight_decay"]) for g in param_groups(tiny(**mup), OPTIM)]
    assert at_base == [(g["muon"], g["lr"], g["lr_mult"], g["weight_decay"]) for g in param_groups(tiny(), OPTIM)]
    torch.manual_seed(0)
    wide = GPT(GPTConfig(n_layer=2, n_head=4, d_model=128, context_length=16, vocab_size=64, **mup))  # m = 4
    assert wide.logit_mult == 0.25  # muP's own multipliers act
    groups = param_groups(wide, OPTIM)
    assert [(g["muon"], g["lr"], g["lr_mult"], g["weight_decay"]) for g in groups] == at_base
    opt = Muon(groups, lr=3e-3, ns_dtype="float32")
    idx = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(15):
        loss = torch.nn.functional.cross_entropy(wide(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses  # mup + Muon learns


@pytest.mark.parametrize("coeffs, lo, hi", [("quintic", 0.5, 1.4), ("polar_express", 0.8, 1.2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_newton_schulz_puts_every_singular_value_near_one(dtype, coeffs, lo, hi):
    g = torch.randn(96, 24) @ torch.diag(torch.logspace(-1, 1, 24))  # condition number ~100
    s = torch.linalg.svdvals(orthogonalize(g, 5, dtype, coeffs).float())
    assert s.min() > lo and s.max() < hi, s
    assert torch.linalg.svdvals(g).max() / torch.linalg.svdvals(g).min() > 30


@pytest.mark.parametrize("coeffs", list(NS_SCHEDULES))
def test_the_gram_iteration_gives_the_same_iterates_as_iterating_on_x(coeffs):
    torch.manual_seed(0)
    x = torch.randn(3, 16, 64, dtype=torch.float64) @ torch.diag(torch.logspace(-1, 0, 64, dtype=torch.float64))
    x = x / x.norm(dim=(-2, -1), keepdim=True)
    schedule = ns_schedule(coeffs, 6)  # past the table's end: its last entry repeats
    assert schedule[5] == schedule[4] and len(set(schedule)) == (5 if coeffs == "polar_express" else 1)
    torch.testing.assert_close(_iterate_gram(x, schedule), _iterate(x, schedule), rtol=1e-9, atol=1e-10)


def test_the_adamw_groups_are_torch_adamw_bitwise():
    a, b = tiny(), tiny()
    groups = [{"params": list(a.parameters()), "weight_decay": 0.1}]
    ref = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), fused=True)
    ours = Muon([{"params": list(b.parameters()), "weight_decay": 0.1}], lr=1e-2, fused=True)
    for step in range(3):
        for net, opt in ((a, ref), (b, ours)):
            opt.zero_grad()
            backward(net, step)
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    for p, q in zip(a.parameters(), b.parameters()):
        assert all(torch.equal(ref.state[p][k], ours.state[q][k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def state(net: GPT, opt: Muon) -> dict:
    return {
        "params": [p.detach().clone() for p in net.parameters()],
        "state": [{k: v.clone() for k, v in opt.state[p].items()} for p in net.parameters()],
    }


def equal(x: dict, y: dict) -> bool:
    params = all(torch.equal(p, q) for p, q in zip(x["params"], y["params"]))
    return params and all(
        s.keys() == t.keys() and all(torch.equal(s[k], t[k]) for k in s) for s, t in zip(x["state"], y["state"])
    )


def test_found_inf_leaves_weights_momentum_and_step_counts_bitwise_untouched_on_both_kinds_of_group():
    net = tiny(mlp="swiglu", n_kv_head=2)
    opt = muon_opt(net)
    assert opt.defaults["fused"] and not muon_opt(net, fused=False).defaults["fused"]  # what deferring reads
    for step in range(2):
        opt.zero_grad()
        backward(net, step)
        opt.step()
    before = state(net, opt)
    assert any("momentum_buffer" in s for s in before["state"]) and any("exp_avg" in s for s in before["state"])
    net.blocks[0].attn.qkv.weight.grad[0, 0] = float("nan")  # as the probe sees it: one poisoned gradient
    net.wte.weight.grad[1, 1] = float("inf")
    opt.found_inf = torch.ones(())
    opt.step()
    assert equal(before, state(net, opt))

    twin = copy.deepcopy((net, opt))  # the same step, applied with found_inf=0 and without the attribute
    assert not hasattr(twin[1], "found_inf")
    for n, o, flag in ((net, opt, torch.zeros(())), (*twin, None)):
        o.zero_grad()
        backward(n, 7)
        if flag is not None:  # the deep copy leaves the attribute behind, as the suite's `finish` does
            o.found_inf = flag
        o.step()
    after = state(net, opt)
    assert not equal(before, after) and equal(after, state(*twin))


def test_state_dict_round_trip_continues_bitwise():
    net = tiny()
    opt = muon_opt(net)
    for step in range(2):
        opt.zero_grad()
        backward(net, step)
        opt.step()
    net2 = copy.deepcopy(net)
    opt2 = muon_opt(net2)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert [g["muon"] for g in opt2.param_groups] == [g["muon"] for g in opt.param_groups]
    for n, o in ((net, opt), (net2, opt2)):
        o.zero_grad()
        backward(n, 5)
        o.step()
    assert equal(state(net, opt), state(net2, opt2))


def test_a_state_dict_from_before_ns_coeffs_loads_as_the_quintic_it_was_trained_with():
    net = tiny()
    old = muon_opt(net).state_dict()
    for group in old["param_groups"]:
        del group["ns_coeffs"]  # written before the key existed
    opt = Muon(param_groups(net, OPTIM), lr=OPTIM["lr"], ns_coeffs="polar_express", ns_dtype="float32")
    opt.load_state_dict(old)
    assert {g["ns_coeffs"] for g in opt.param_groups} == {"quintic"}
    backward(net, 0)
    opt.step()
    assert all(torch.isfinite(p).all() for p in net.parameters())


RUN = [
    "optim=muon",
    "optim.warmup_steps=3",
    "trainer.log_every_n_steps=1",
    "callbacks.checkpoint.every_n_train_steps=5",
]


def test_a_muon_run_trains_deferred_and_resumes_bitwise(make_cfg, tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    metrics, objs = train(make_cfg(*RUN, "optim.total_steps=20", "trainer.max_steps=20", out=full))
    opt = objs["trainer"].optimizers[0]
    assert isinstance(opt, Muon) and opt.defaults["fused"]
    assert sum(g["muon"] for g in opt.param_groups) >= 1
    assert metrics["val/loss"] < 4.0  # from ln(257) = 5.55 at the start: it learns
    train(make_cfg(*RUN, "optim.total_steps=20", "trainer.max_steps=10", out=split))
    train(make_cfg(*RUN, "optim.total_steps=20", "trainer.max_steps=20", "resume=auto", out=split))
    a, b = safe_load(full / "checkpoints" / "last.ckpt"), safe_load(split / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == 20
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    sa, sb = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert any("momentum_buffer" in s for s in sa.values())
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


class AroundStep(L.Callback):
    """Weights and Muon/AdamW state just before and just after optimizer step `step`."""

    def __init__(self, step: int):
        self.step, self.before, self.after = step, None, None

    @staticmethod
    def _state(trainer, pl_module) -> dict:
        return state(pl_module, trainer.optimizers[0])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.before = self._state(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step + 1:
            self.after = self._state(trainer, pl_module)


def test_an_inf_gradient_under_muon_is_skipped_on_the_device_and_the_run_carries_on(make_cfg, tmp_path):
    around = AroundStep(25)
    objs = build(make_cfg("optim=muon", "experiment=divergence/inf_grad"))
    objs["trainer"].callbacks.append(around)
    objs["trainer"].fit(objs["module"], datamodule=objs["datamodule"])
    events = [(e["step"], e["kind"], e["action"], e["detail"].get("module")) for e in read_events(tmp_path / "run")]
    assert events == [(25, "nonfinite_grad", "skip", "blocks.0.attn.qkv")]  # a Muon matrix
    assert objs["module"].skipped_steps == 1 and objs["trainer"].global_step == 30
    assert equal(around.before, around.after)  # weights, momentum, moments and step counts
    assert all(p.isfinite().all() for p in objs["module"].parameters())


@pytest.mark.slow
def test_two_process_ddp_under_muon_skips_a_rank_1_inf_on_both_ranks_and_resumes_bitwise(shards_dir, tmp_path):
    """An inf gradient on rank 1 only (after the all-reduce) skips the step on both ranks, Muon's momentum included;
    a resume from the step-4 checkpoint reaches step 8 with both ranks' weights and Muon state equal to the run's."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    args = [
        *DDP_TWO_CPU,
        *CLI_TINY,
        f"data.dir={shards_dir}",
        "optim=muon",
        "trainer.max_steps=8",
        "trainer.limit_val_batches=0",
        "callbacks.checkpoint.every_n_train_steps=4",
        "callbacks.checkpoint.save_top_k=-1",
    ]
    inf = faults({"kind": "inf_grad", "step": 2, "rank": 1, "param": "blocks.0.attn.qkv.weight"})
    for out, extra in ((full, [inf]), (resumed, [f"ckpt_path={full / 'checkpoints' / 'step0000004.ckpt'}"])):
        out.mkdir()
        hashes = f"+callbacks.hash={{_target_: tests.helpers.ParamHash, out: {out}}}"
        proc = run_cli(*args, *extra, f"hydra.run.dir={out}", hashes, cwd=tmp_path, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = {out: [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)] for out in (full, resumed)}
    assert ranks[full][0] == ranks[full][1] == ranks[resumed][0] == ranks[resumed][1]
    assert ranks[full][0]["skipped"] == 1 and ranks[full][0]["step"] == 8
    assert [(e["step"], e["kind"], e["action"]) for e in read_events(full)] == [(2, "nonfinite_grad", "skip")]
    a, b = safe_load(full / "checkpoints" / "last.ckpt"), safe_load(resumed / "checkpoints" / "last.ckpt")
    sa, sb = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert any("momentum_buffer" in s for s in sa.values())
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_export_generate_doctor_and_diagnose_work_on_a_muon_run(make_cfg, tmp_path, capsys):
    pytest.importorskip("transformers")
    run = tmp_path / "run"
    train(make_cfg("optim=muon", "trainer.max_steps=6", "optim.warmup_steps=2", "trainer.val_check_interval=6"))
    ckpt = run / "checkpoints" / "last.ckpt"
    capsys.readouterr()  # the training's own output
    generate_main([f"ckpt={ckpt}", 'prompt="def "', "max_new_tokens=8", "device=cpu"])
    assert capsys.readouterr().out.startswith("def ")
    export_main([f"ckpt={ckpt}", f"out={tmp_path / 'hf'}"])
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    rows = run_checks(make_cfg("optim=muon"), out_dir=tmp_path / "doctor")
    assert not [r for r in rows if r.status == FAIL], rows
    diagnose_main([str(run)])
    facts = (run / "report.md").read_text()
    assert "optim=muon (adjust_lr=match_rms_adamw, lr_mult=1.0, ns_dtype=auto; AdamW on the rest)" in facts


@pytest.mark.slow
def test_time_to_loss_quick_mode_prints_every_row_and_the_step_cost(tmp_path):
    out = tmp_path / "ttl.json"
    bench = str(ROOT / "benchmarks" / "time_to_loss.py")
    run = subprocess.run([sys.executable, bench, "--quick", "--json", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(out.read_text())
    assert set(r["rows"]) == {"steadylm adamw", "steadylm muon", "plain loop adamw"}
    assert r["rows"]["steadylm adamw"]["ratios_steps_wall_cpu"] == [1.0, 1.0, 1.0]
    assert all(len(row["curve"]) == 2 for row in r["rows"].values())  # 20 steps, val every 10
    paired = r["paired"]
    assert paired["step_ratio_90"][0] <= paired["step_ratio"] <= paired["step_ratio_90"][1]
    if r["rows"]["steadylm muon"]["reached"]:
        assert paired["wall_x"] == pytest.approx(paired["steps_x"] * paired["step_ratio"])
    assert len(paired["rounds"]) == 2 and "interleaved: a Muon step costs" in run.stdout
    cost = subprocess.run([sys.executable, bench, "--quick", "--step-cost"], capture_output=True, text=True)
    line = cost.stdout.strip().splitlines()[-1]
    muon, adamw = (float(x) for x in re.findall(r"(?:muon|adamw) (\d\.\d+)", line))
    assert line.startswith("optimizer step / training step: muon") and 0 < adamw < muon < 1, line
