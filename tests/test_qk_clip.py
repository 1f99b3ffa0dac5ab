"""QK-clip: the per-head rescaling brings exactly the heads above tau down to tau (MHA, GQA, RoPE), it is
bounded and its state survives a checkpoint, and the default callbacks clip a high-LR run but never a healthy one."""

from __future__ import annotations

import json

import pytest
import torch

from steadylm.errors import ConfigError
from steadylm.model import GPT, GPTConfig
from steadylm.schedule import Schedule
from steadylm.stability import read_events
from steadylm.stability.qk_clip import QKClip
from steadylm.train import train
from tests.helpers import CLI_TINY, DDP_TWO_CPU, faults, fit, run_cli, stability_of


def head_maxima(net: GPT, x: torch.Tensor) -> list[torch.Tensor]:
    for b in net.blocks:
        b.attn.track_max_logit = True
    net(x)
    return [b.attn.head_max_logit.clone() for b in net.blocks]


@pytest.mark.parametrize(
    "shape",
    [
        dict(n_head=4),  # one key head per query head: sqrt(tau / S) on both
        dict(n_head=4, n_kv_head=2),  # grouped-query: a key head shared by two query heads
        dict(n_head=4, n_kv_head=1, pos="rope", bias=False),  # rotary positions, one key head for all
    ],
)
def test_clipped_heads_end_at_tau_and_the_others_keep_their_logits(shape):
    torch.manual_seed(0)
    net = GPT(GPTConfig(n_layer=1, d_model=64, context_length=32, vocab_size=64, **shape))
    attn, D = net.blocks[0].attn, net.blocks[0].attn.head_dim
    with torch.no_grad():  # blow up query heads 1 and 3 (in different key groups under n_kv_head=2)
        attn.qkv.weight[D : 2 * D] *= 60.0
        attn.qkv.weight[3 * D : 4 * D] *= 30.0
    x = torch.randint(0, 64, (2, 32))
    (before,) = head_maxima(net, x)
    tau = 3.0 * float(max(before[0], before[2]))
    assert float(before[1]) > tau and float(before[3]) > tau
    policy = QKClip(tau=tau, min_factor=1e-4)
    evidence = policy.step(7, [before], [attn])
    (after,) = head_maxima(net, x)
    assert after.tolist() == pytest.approx([before[0].item(), tau, before[2].item(), tau], rel=1e-4)
    assert evidence["clips"] == 1 and evidence["head"] == max((1, 3), key=lambda h: before[h])
    assert {(layer, head) for layer, head, _ in evidence["heads_clipped"]} == {(0, 1), (0, 3)}
    assert policy.step(8, [torch.full((4,), tau)], [attn]) is None  # at tau: nothing to do


@pytest.mark.parametrize("kernel", ["mask", "flex"])
@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
def test_logits_across_documents_never_clip_under_pack_doc(kernel):
    """Only token A's query meets token B's key with a large logit, and B ends the document before A's: under
    data.pack=doc attention never uses that pair, so the max logit QK-clip and the stats read stays small and nothing
    clips (on either kernel); without packing the pair is used, and it clips."""
    SEP, B, A, FILL = 0, 1, 2, 5
    torch.manual_seed(0)
    net = GPT(GPTConfig(n_layer=1, n_head=1, d_model=32, context_length=12, vocab_size=16, dropout=0.0))
    attn, D = net.blocks[0].attn, net.blocks[0].attn.head_dim
    with torch.no_grad():
        net.wpe.weight.zero_()
        net.wte.weight.copy_(torch.eye(16, 32))  # token t: along axis t, so after ln_1 about sqrt(31) there
        attn.qkv.weight.zero_()
        attn.qkv.bias.zero_()
        attn.qkv.weight[0, A] = attn.qkv.weight[D, B] = 10.0  # q = 10·h[A] e0, k = 10·h[B] e0
    x = torch.tensor([[FILL, B, FILL, SEP, A, FILL, A, FILL, FILL, A, FILL, FILL]])
    policy = QKClip(tau=100.0)
    with torch.no_grad():
        net.doc_separator, net.doc_kernel = SEP, kernel
        (packed,) = head_maxima(net, x)
        assert float(attn.max_logit) == float(packed[0]) < 5.0  # the stats' number is the same one
        before = attn.qkv.weight.clone()
        assert policy.step(0, [packed], [attn]) is None and torch.equal(attn.qkv.weight, before)
        net.doc_separator = None  # one sequence: A's queries see B's key
        (plain,) = head_maxima(net, x)
        assert float(plain[0]) > 500.0
        evidence = policy.step(1, [plain], [attn])
    assert evidence["clips"] == 1 and evidence["max_logit"] == pytest.approx(float(plain[0]))
    assert not torch.equal(attn.qkv.weight, before)


def test_the_policy_is_bounded_and_its_state_round_trips():
    attn = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, context_length=8, vocab_size=16)).blocks[0].attn
    policy = QKClip(tau=10.0, min_factor=0.5, max_clips=3, backoff_after=2, lr_backoff=0.5, max_backoffs=1)
    w = attn.qkv.weight.detach().clone()
    first = policy.step(0, [torch.tensor([1000.0, float("nan")])], [attn])
    assert first["factor"] == 0.5  # tau / S = 0.01, floored by min_factor
    q_rows = attn.qkv.weight[:8]  # head 0's query rows scaled by 0.5 / sqrt(0.5), its key rows by sqrt(0.5)
    assert torch.allclose(q_rows, w[:8] * 0.5**0.5) and torch.allclose(attn.qkv.weight[16:24], w[16:24] * 0.5**0.5)
    assert torch.equal(attn.qkv.weight[8:16], w[8:16])  # head 1 measured NaN: ignored, untouched
    assert torch.equal(attn.qkv.weight[32:], w[32:])  # values never change
    second = policy.step(1, [torch.tensor([20.0, 5.0])], [attn])
    assert second["lr_backoff"] == 0.5 and second["lr_scale"] == 0.5  # two clipping measurements in a row
    third = policy.step(2, [torch.tensor([20.0, 5.0])], [attn])
    assert "lr_backoff" not in third and third["exhausted"]  # max_backoffs=1; max_clips=3 reached
    state = json.loads(json.dumps(policy.state_dict()))
    w = attn.qkv.weight.detach().clone()
    resumed = QKClip(tau=10.0, max_clips=3)
    resumed.load_state_dict(state)
    assert resumed.step(3, [torch.tensor([50.0, 5.0])], [attn]) is None and torch.equal(attn.qkv.weight, w)
    assert (resumed.clips, resumed.backoff.backoffs, resumed.lr_scale) == (3, 1, 0.5)
    rewinding = QKClip(tau=10.0, backoff_after=2, rewind=True, rewind_to="onset")  # a backoff names where to rewind
    assert rewinding.step(5, [torch.tensor([20.0, 5.0])], [attn])["clips"] == 1
    assert rewinding.step(6, [torch.tensor([20.0, 5.0])], [attn])["rewind_before"] == 4  # before the onset, 5


def test_a_rewind_warms_the_lr_up_again_from_the_restored_step():
    """After a rewind to applied step 20 with a 100-step re-warmup: 1/100 of the LR at step 20, half at 69, all of
    it from 120 on; before the rewind's step, and with no re-warmup, the schedule alone."""
    flat = Schedule(lr=1.0, min_lr=1.0, warmup_steps=1, total_steps=1000)  # LR 1 at every step after the first
    assert [flat.lr_of(s, rewarm=(20, 100)) for s in (20, 69, 119, 120, 500)] == [0.01, 0.5, 1.0, 1.0, 1.0]
    assert flat.lr_of(19, rewarm=(20, 100)) == 1.0 and flat.lr_of(20, rewarm=(0, 0)) == 1.0
    with pytest.raises(ConfigError, match=r"rewarm_steps=-1 must be an integer >= 0"):
        QKClip(rewarm_steps=-1)


def test_growth_in_the_warmup_rewinds_to_the_first_snapshot_beyond_keep(make_cfg, tmp_path):
    """keep=1 snapshot every 5 steps: by the streak only the newest is in `keep`, but the logits grew during the
    LR warmup, so the rewind goes back to the fit's first snapshot, held until the warmup is over."""
    _, objects = train(
        make_cfg(
            "model.qk_norm=false",
            "optim.lr=0.1",
            "optim.warmup_steps=20",
            "trainer.max_steps=50",
            "callbacks.stability.qk_clip.backoff_after=2",
            "callbacks.stability.recovery.every_n_steps=5",
            "callbacks.stability.recovery.keep=1",
            "callbacks.checkpoint.every_n_train_steps=50",
            "callbacks.stability.signals=null",  # QK-clip's own hold (the signals' streak would hold it longer)
        )
    )
    events = read_events(tmp_path / "run")
    rewinds = [e for e in events if e["kind"] == "rollback"]
    assert rewinds and rewinds[0]["detail"]["cause"] == "qk_clip", [(e["step"], e["kind"]) for e in events]
    assert rewinds[0]["detail"]["onset"] > 5 and rewinds[0]["detail"]["to_step"] == 0  # a snapshot at 5 exists
    recovery = stability_of(objects["trainer"]).recovery
    assert recovery.first is None  # released once the warmup was over
    assert len(recovery.good) == 1  # keep


def test_logits_above_the_floor_from_the_start_rewind_to_the_earliest_snapshot_kept(make_cfg, tmp_path):
    """Trained weights' logits start above growth_floor * tau (here a floor of 1e-4, under any logit): the growth
    began before the first measurement, so a backoff after the first snapshot's hold rewinds to the earliest
    snapshot kept, not to the newest from before the streak, which holds weights from inside the growth."""
    train(
        make_cfg(
            "model.qk_norm=false",
            "optim.lr=0.03",
            "optim.warmup_steps=2",
            "trainer.max_steps=60",
            "callbacks.stability.qk_clip.backoff_after=2",
            "callbacks.stability.qk_clip.growth_floor=1e-6",
            "callbacks.stability.recovery.every_n_steps=5",
            "callbacks.checkpoint.every_n_train_steps=60",
            "callbacks.stability.signals=null",
        )
    )
    events = read_events(tmp_path / "run")
    backoff = next(e for e in events if e["kind"] == "lr_backoff")
    rewind = next(e for e in events if e["kind"] == "rollback")
    newest = (backoff["detail"]["onset"] - 1) // 5 * 5  # the newest snapshot from before the streak
    assert newest >= 10 and backoff["detail"]["growth_from"] is None, [(e["step"], e["kind"]) for e in events]
    assert rewind["detail"]["to_step"] == backoff["detail"]["rewound_to"] == newest - 5  # keep=2: the older one


@pytest.mark.slow
def test_default_callbacks_clip_a_high_lr_run_and_resume_with_the_counts(make_cfg, tmp_path):
    """lr 0.1 without QK-norm: clips from the first steps past tau, events with evidence; a streak of clips lowers
    the LR x0.1 and rewinds to the snapshot from before it, the schedule resuming there; counts in the checkpoint.
    This small model clips on and off, so the streak is 2 here (5 by default)."""
    overrides = ("model.qk_norm=false", "optim.lr=0.1", "optim.warmup_steps=5", "trainer.max_steps=30")
    streak = "callbacks.stability.qk_clip.backoff_after=2"
    _, objects = train(make_cfg(*overrides, streak, "callbacks.checkpoint.every_n_train_steps=30"))
    events = read_events(tmp_path / "run")
    clips = [e for e in events if e["kind"] == "qk_clip"]
    assert len(clips) >= 2, clips
    assert all(e["detail"]["max_logit"] > 100.0 and e["detail"]["heads_clipped"] for e in clips)
    backoffs = [e for e in events if e["kind"] == "lr_backoff"]
    rewinds = [e for e in events if e["kind"] == "rollback"]
    assert 1 <= len(backoffs) == len(rewinds) <= 2  # max_backoffs
    backoff, rewind = backoffs[0], rewinds[0]
    onset = backoff["detail"]["onset"]
    assert backoff["step"] == onset + 1 and backoff["detail"]["lr_scale"] == pytest.approx(0.1)
    assert objects["module"].lr_scale == pytest.approx(0.1 ** len(backoffs))
    assert rewind["detail"]["cause"] == "qk_clip" and rewind["detail"]["source"] == "snapshot_file"
    assert rewind["step"] == backoff["step"] and rewind["detail"]["to_step"] == backoff["detail"]["rewound_to"] < onset
    assert backoff["detail"]["rewarm_steps"] == 100  # the LR warms up again from the restored weights
    start, length = objects["module"].rewarm
    assert length == 100 and start == backoffs[-1]["detail"]["rewound_to"]  # no step skipped before: applied = step
    if len(rewinds) == 1:  # the schedule resumed at the rewound weights (accounted a step late): the steps since
        assert objects["module"].skipped_steps == backoff["step"] + 2 - rewind["detail"]["to_step"]  # no longer count
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    state = ckpt["callbacks"]["steadylm.stability"]["qk_clip"]
    assert state["clips"] == len(clips)
    resume = ("trainer.max_steps=32", "optim.total_steps=30", f"ckpt_path={tmp_path / 'run/checkpoints/last.ckpt'}")
    after = make_cfg(*overrides, streak, *resume)  # the same schedule, its LR at min_lr past step 30
    _, resumed = train(after)
    assert stability_of(resumed["trainer"]).qk_clip.clips >= len(clips)
    assert resumed["module"].rewarm == (start, length)  # the re-warmup survives the checkpoint


@pytest.mark.slow
def test_a_healthy_run_is_never_clipped(make_cfg, tmp_path):
    train(make_cfg("model.qk_norm=false", "trainer.max_steps=60"))
    assert not [e for e in read_events(tmp_path / "run") if e["kind"] in ("qk_clip", "lr_backoff")]


def test_a_rollback_never_clips_the_restored_weights_by_the_abandoned_steps_logits(make_cfg, tmp_path):
    """tau so low that every measured step clips: the step a rollback happens in measured its logits on the
    weights the rollback abandons, so it must clip (and record) nothing."""
    out = tmp_path / "run"
    cfg = make_cfg(
        "trainer.max_steps=70",
        "callbacks.stability.defer=false",  # the rollback happens inside the step it is judged at
        "callbacks.stability.qk_clip.tau=1e-3",
        "callbacks.stability.qk_clip.lr_backoff=null",
        faults({"kind": "lr_spike", "step": 50, "factor": 1000}),
        out=out,
    )
    fit(cfg)
    events = read_events(out)
    rollbacks = [e["step"] for e in events if e["kind"] == "rollback"]
    clipped = {e["step"] for e in events if e["kind"] == "qk_clip"}
    assert rollbacks, [(e["step"], e["kind"]) for e in events]
    assert 49 in clipped and not clipped & set(rollbacks), (sorted(clipped), rollbacks)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_process_ddp_clips_backs_off_and_rewinds_every_rank_alike(shards_dir, tmp_path, strategy):
    """lr 0.1 without QK-norm on 2 ranks that see different data: each rank's logits differ, the clip factors come
    from their all-reduced maxima, so both ranks clip, back off and rewind at the same steps to the same weights
    (DDP averages gradients, never weights: a factor that differed by rank would leave the ranks apart; without
    the all-reduce this test fails). Under FSDP2 each rank rescales its own rows of q and k: the same natural
    instability ends `unstable` the same way, the ranks at the same step with the same skips."""
    out = tmp_path / strategy
    out.mkdir()
    proc = run_cli(
        *(DDP_TWO_CPU if strategy == "ddp" else ["trainer=fsdp_sim"]),
        *CLI_TINY,
        f"data.dir={shards_dir}",
        f"hydra.run.dir={out}",
        "model.n_layer=2",
        "model.d_model=64",
        "model.qk_norm=false",
        "optim.lr=0.1",
        "optim.warmup_steps=5",
        "trainer.max_steps=40",
        "trainer.limit_val_batches=0",
        "callbacks.stability.recovery.every_n_steps=5",
        "callbacks.stability.qk_clip.backoff_after=2",
        "callbacks.stability.qk_clip.max_backoffs=1",
        "callbacks.stability.qk_clip.lr_backoff=0.5",
        "callbacks.stability.qk_clip.rewarm_steps=0",  # the LR back at once, so the logits cross tau again
        "callbacks.checkpoint.every_n_train_steps=1000",
        f"+callbacks.hash={{_target_: tests.helpers.ParamHash, out: {out}}}",
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]  # `unstable` is a finished run: exit 0
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    if strategy == "fsdp":  # each rank holds its own shard of the weights
        ranks = [{k: v for k, v in r.items() if k != "hash"} for r in ranks]
    assert ranks[0] == ranks[1]  # the same clips, the same rewinds, the same weights
    events = read_events(out)
    backoffs = [e for e in events if e["kind"] == "lr_backoff"]
    rewinds = [e for e in events if e["kind"] == "rollback"]
    assert len(backoffs) == len(rewinds) == 1, [(e["step"], e["kind"]) for e in events]  # max_backoffs
    # x0.5 leaves the LR high enough to clip after the rewind: the clips the final weights carry
    assert [e for e in events if e["kind"] == "qk_clip" and e["step"] > rewinds[0]["step"]]
    assert all(r["detail"]["cause"] == "qk_clip" and r["detail"]["source"] == "snapshot_file" for r in rewinds)
    assert json.loads((out / "result.json").read_text())["status"] == "unstable"


def test_the_rewind_goes_back_only_as_far_as_the_logits_grew():
    """`growth`: back to the last step the max logit stood at or below growth_floor * tau (here 25 with growth_floor=0.25), not to the
    start; with no such step (above the floor from the start) to the first snapshot, else the earliest kept (no
    snapshot is from at or before step -1), not the newest before the streak; `onset`: just before the streak; a
    history survives the checkpoint."""
    attn = GPT(GPTConfig(n_layer=1, n_head=2, d_model=8, context_length=4, vocab_size=16)).blocks[0].attn
    clip = QKClip(tau=100.0, backoff_after=2, growth_floor=0.25)
    for step, peak in enumerate([10.0, 12.0, 20.0, 40.0, 80.0, 120.0]):
        evidence = clip.step(step, [torch.tensor([peak, 1.0])], [attn])
    evidence = clip.step(6, [torch.tensor([150.0, 1.0])], [attn])
    assert evidence["onset"] == 5 and evidence["rewind_before"] == 2 and evidence["growth_from"] == 2
    assert evidence["rewind_first"] is False
    hot = QKClip(tau=100.0, backoff_after=2, growth_floor=0.25)
    for step, peak in enumerate([50.0, 120.0, 130.0]):
        evidence = hot.step(step, [torch.tensor([peak, 1.0])], [attn])
    assert evidence["rewind_before"] == -1 and evidence["rewind_first"] is True and evidence["growth_from"] is None
    shallow = QKClip(tau=100.0, backoff_after=2, rewind_to="onset")
    for step, peak in enumerate([10.0, 40.0, 120.0, 130.0]):
        evidence = shallow.step(step, [torch.tensor([peak, 1.0])], [attn])
    assert evidence["rewind_before"] == 1 and evidence["rewind_first"] is False
    again = QKClip()
    again.load_state_dict(clip.state_dict())
    assert list(again.history) == list(clip.history)[-len(again.history) :] and len(again.history) == 7
    with pytest.raises(ConfigError, match=r"rewind_to='start' is not allowed; use one of: growth, onset, first"):
        QKClip(rewind_to="start")
