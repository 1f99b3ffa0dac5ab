"""`data.sources`: several prepared folders trained at fixed token shares, a val loss per source, exact resume."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pytest

from steadylm.data.mixture import MixtureBatchSampler, MixtureOrder
from steadylm.data.prepare import prepare
from steadylm.errors import ConfigError, DataError
from steadylm.train import train
from tests.test_resume import RESUME, K, step_losses


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory) -> dict[str, Path]:
    """`big`: the embedded corpus's first 300 KB; `small`: its first 60 KB (small enough to run out first)."""
    root = tmp_path_factory.mktemp("sources")
    for name, size in (("big", 300_000), ("small", 60_000)):
        prepare(input=None, out_dir=root / name, max_bytes=size, val_fraction=0.05, progress=False)
    return {"big": root / "big", "small": root / "small"}


def sources(paths: dict[str, Path], big: float = 0.7, small: float = 0.3) -> str:
    return f"data.sources={{big: {{dir: {paths['big']}, weight: {big}}}, small: {{dir: {paths['small']}, weight: {small}}}}}"


@pytest.mark.parametrize("weights", [(0.7, 0.3), (0.5, 0.3, 0.2), (0.95, 0.05)])
def test_every_100_steps_hold_the_weights_within_1_percent(weights):
    """Window shares over every run of 100 steps of 16 windows; windows are T + 1 tokens each, so token shares too."""
    sizes = [40_000, 700, 9_000][: len(weights)]
    ids = MixtureOrder(sizes, list(weights), seed=5)(np.arange(200 * 1600))
    source = np.searchsorted(np.cumsum(sizes), ids, side="right")
    for s, w in enumerate(weights):
        share = np.convolve(source == s, np.ones(1600), "valid") / 1600
        assert abs(share.min() - w) <= 0.01 * w and abs(share.max() - w) <= 0.01 * w, (s, share.min(), share.max())


def test_a_source_that_runs_out_starts_its_next_epoch_alone():
    """The small source's draws: each epoch every window once, a new order each epoch; the big one still in its first."""
    order = MixtureOrder([5_000, 300], [0.5, 0.5], seed=1)
    ids = order(np.arange(3_000))
    small = ids[ids >= 5_000] - 5_000
    assert len(small) == 1_500
    epochs = [small[i : i + 300] for i in range(0, 1_500, 300)]
    assert all(sorted(e.tolist()) == list(range(300)) for e in epochs)
    assert not np.array_equal(epochs[0], epochs[1])
    big = ids[ids < 5_000]
    assert len(set(big.tolist())) == len(big) == 1_500  # no big window twice yet


def test_the_same_windows_on_one_rank_or_two():
    """A step's global batch is a function of the seed and the step: 1 rank x 16 = 2 ranks x 8, window for window."""
    order = MixtureOrder([5_000, 300], [0.6, 0.4], seed=2)
    one = MixtureBatchSampler(order, 16, world_size=1, rank=0)
    two = [MixtureBatchSampler(MixtureOrder([5_000, 300], [0.6, 0.4], seed=2), 8, world_size=2, rank=r) for r in (0, 1)]
    for step in (0, 1, 7, 300, len(one) - 1):
        assert sorted(one.batch_windows(step)) == sorted(two[0].batch_windows(step) + two[1].batch_windows(step))
    # 16 windows a step as 1 rank x 8 x 2 micro-batches: optimizer step k reads what 1 x 16 reads at step k
    accumulated = MixtureBatchSampler(MixtureOrder([5_000, 300], [0.6, 0.4], seed=2), 8, step_batches=2)
    assert len(accumulated) == 2 * len(one)
    for step in (0, 3, 150):
        both = accumulated.batch_windows(2 * step) + accumulated.batch_windows(2 * step + 1)
        assert sorted(both) == sorted(one.batch_windows(step))


def test_a_mixture_trains_and_reports_a_val_loss_per_source(make_cfg, two_sources, caplog):
    with caplog.at_level(logging.INFO, logger="steadylm"):
        metrics, objects = train(
            make_cfg(sources(two_sources), "trainer.max_steps=20", "trainer.val_check_interval=20")
        )
    big, small = metrics["val/loss/big"], metrics["val/loss/small"]
    assert metrics["val/loss"] == pytest.approx(0.7 * big + 0.3 * small, rel=1e-6)
    assert "val/bpb/big" in metrics and metrics["val/bpb"] == pytest.approx(
        0.7 * metrics["val/bpb/big"] + 0.3 * metrics["val/bpb/small"], rel=1e-6
    )
    dm = objects["datamodule"]
    trained = [w for step in range(20) for w in dm._train_sampler.batch_windows(step)]
    names = [dm.window_location(w)["source"] for w in trained]
    assert abs(names.count("big") / len(names) - 0.7) <= 0.01  # 320 windows: 224 and 96
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data.sources.")]
    assert len(lines) == 2 and "data.sources.big: 70.0% of the tokens" in lines[0], lines
    assert "data.sources.small: 30.0% of the tokens" in lines[1] and "epochs of it" in lines[1]
    where = dm.window_location(trained[0])
    assert where["source"] in ("big", "small") and where["shard"].startswith("train-") and where["end"] > where["start"]


def test_result_summary_and_diagnose_show_each_source(make_cfg, two_sources, tmp_path):
    import json

    from steadylm.diagnose import analyse, load_run
    from steadylm.result import RESULT_FILE, finish_job
    from steadylm.sweep import summary_table

    cfg = make_cfg(sources(two_sources), "trainer.max_steps=10", "trainer.val_check_interval=10")
    metrics, _ = train(cfg)
    finish_job(cfg, metrics)
    result = json.loads((tmp_path / "run" / RESULT_FILE).read_text())
    assert result["val_loss_by_source"] == {"big": metrics["val/loss/big"], "small": metrics["val/loss/small"]}
    table = summary_table([{"job": "0", **result}])
    assert "| by source |" in table and f"big {metrics['val/loss/big']:.4g}, small" in table
    assert "by source" not in summary_table([{"job": "0", "status": "ok", "val_loss": 1.0}])
    facts = analyse(load_run(tmp_path / "run")).facts
    assert any(f.startswith("val/loss by source, last: big ") for f in facts), facts


def test_a_mixture_resumes_bitwise(make_cfg, two_sources, tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    mix = sources(two_sources)
    train(make_cfg(*RESUME, mix, f"trainer.max_steps={2 * K}", out=full))
    train(make_cfg(*RESUME, mix, f"trainer.max_steps={K}", out=split))
    train(make_cfg(*RESUME, mix, f"trainer.max_steps={2 * K}", "resume=auto", out=split))
    expected, got = step_losses(full), step_losses(split)
    assert len(expected) == 2 * K and got == expected


def _windows(objects, steps) -> list[list[int]]:
    """The windows each of `steps` trained on (one micro-batch a step), from the run's own sampler."""
    return [objects["datamodule"]._train_sampler.batch_windows(step) for step in steps]


def test_a_resume_at_other_weights_applies_them_from_its_step_and_repeats_nothing(
    make_cfg, two_sources, tmp_path, caplog
):
    """8 steps at 70/30, resumed to 16 at 50/50 (an annealing phase): one line says so; steps 8..15 draw 50/50 and
    read no window that steps 0..7 read (counted from the start at the new shares, big would repeat 13 windows); a
    second resume from step 12 goes on exactly as the run that did not stop."""
    run, again = tmp_path / "run", tmp_path / "again"
    keep = ["optim.total_steps=16", "optim.warmup_steps=2", "callbacks.checkpoint.every_n_train_steps=4"]
    keep += ["callbacks.checkpoint.save_top_k=-1", "trainer.val_check_interval=8"]
    _, first = train(make_cfg(*keep, sources(two_sources), "trainer.max_steps=8", out=run))
    with caplog.at_level(logging.INFO, logger="steadylm"):
        _, second = train(
            make_cfg(*keep, sources(two_sources, 0.5, 0.5), "trainer.max_steps=16", "resume=auto", out=run)
        )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume: data.sources")]
    assert lines == [
        "resume: data.sources differ from the checkpoint's (big 70.0% -> 50.0%, small 30.0% -> 50.0%): the new "
        "shares apply from step 8, each source going on with the next window of its own order that it has not read "
        "(nothing repeated or skipped); the checkpoint's data.sources keep the old stream"
    ]
    dm = second["datamodule"]
    before = [w for batch in _windows(first, range(8)) for w in batch]
    after = [w for batch in _windows(second, range(8, 16)) for w in batch]
    assert [dm.window_location(w)["source"] for w in after].count("small") == 32  # 64 windows at 50 %
    assert not set(before) & set(after) and len(set(after)) == len(after)  # both sources in their first epoch
    naive = MixtureOrder(dm.order.sizes.tolist(), [0.5, 0.5], dm.order.seed, names=dm.order.names)(np.arange(64, 128))
    assert len(set(before) & set(naive.tolist())) == 13  # the stream at 50/50 from step 0: big's windows 32..44 again
    ckpt = next((run / "checkpoints").glob("step0000012*.ckpt"))
    _, third = train(
        make_cfg(*keep, sources(two_sources, 0.5, 0.5), "trainer.max_steps=16", f"ckpt_path={ckpt}", out=again)
    )
    assert _windows(third, range(12, 16)) == _windows(second, range(12, 16))


def test_a_resume_with_a_source_of_another_size_is_refused_and_a_new_name_starts_its_order(
    make_cfg, two_sources, tmp_path, caplog
):
    keep = ["optim.total_steps=8", "optim.warmup_steps=1", "trainer.val_check_interval=4"]
    train(make_cfg(*keep, sources(two_sources), "trainer.max_steps=4"))
    other = {"big": two_sources["big"], "small": two_sources["big"]}  # `small` now names 300 KB, not 60 KB
    with pytest.raises(ConfigError) as refused:
        train(make_cfg(*keep, sources(other), "trainer.max_steps=6", "resume=auto"))
    message = str(refused.value)
    assert re.fullmatch(
        r"data\.sources\.small\.dir holds [\d,]+ train windows, and the checkpoint's small held [\d,]+: its order "
        r"cannot go on \(windows would repeat or be skipped\); point data\.sources\.small\.dir at the data it trained "
        r"on, or give the source a new name to start its order",
        message,
    ), message
    assert not (tmp_path / "run" / "checkpoints" / "exception.ckpt").exists()  # refused before training: no save
    renamed = f"data.sources={{big: {{dir: {two_sources['big']}, weight: 0.7}}, more: {{dir: {two_sources['big']}, weight: 0.3}}}}"
    with caplog.at_level(logging.INFO, logger="steadylm"):
        _, objects = train(make_cfg(*keep, renamed, "trainer.max_steps=6", "resume=auto"))
    assert objects["trainer"].global_step == 6
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("resume: data.sources"))
    assert line.startswith("resume: data.sources differ from the checkpoint's (more new at 30.0%, small dropped): ")


@pytest.mark.parametrize(
    "spec, error, message",
    [
        *[
            (
                f"{{a: {{dir: /nowhere, weight: {w}}}}}",
                ConfigError,
                rf"^data\.sources\.a\.weight={shown} is not allowed; it must be a finite number >= 0$",
            )
            for w, shown in (("-1", "-1"), ("inf", "inf"), ("nan", "nan"), ("-inf", "-inf"))
        ],
        (
            "{a: {dir: /nowhere, weight: 1}, b: {dir: /nowhere, weight: 0.0004}}",
            ConfigError,
            r"^data\.sources\.b\.weight=0\.0004 is 0\.040% of the total, under the 0\.1% of one position in 1,000, so "
            r"b would never be drawn; raise it to at least 0\.00101, or set it to 0 to only validate on it$",
        ),
        ("{a: {dir: /nowhere, weight: 0}}", ConfigError, r"^data\.sources: every weight is 0"),
        ("{a: {dir: /nowhere, wieght: 1}}", ConfigError, r"^data\.sources\.a\.wieght is not a source key"),
        ("{a: {weight: 1}}", ConfigError, r"^data\.sources\.a\.dir is not set"),
        ("{a: {dir: /nowhere, weight: 1}}", DataError, r"^/nowhere: data\.sources\.a\.dir does not exist"),
    ],
)
def test_a_bad_source_is_one_line(make_cfg, spec, error, message, tmp_path):
    with pytest.raises(error, match=message):
        train(make_cfg(f"data.sources={spec}"))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_source_with_no_val_window_is_one_line_at_startup(make_cfg, two_sources, tmp_path):
    """30 val tokens under a 64-token context: `val/loss/tiny` would read 0 and pull `val/loss` down by its weight."""
    tiny = tmp_path / "tiny"
    prepare(input=None, out_dir=tiny, max_bytes=60_000, val_fraction=0.0005, progress=False)
    spec = f"data.sources={{big: {{dir: {two_sources['big']}, weight: 0.7}}, tiny: {{dir: {tiny}, weight: 0.3}}}}"
    with pytest.raises(DataError) as refused:
        train(make_cfg(spec))
    assert str(refused.value) == (
        f"{tiny / 'val-00000.h5'}: source 'tiny' has no val window: its longest val shard has 30 tokens, fewer than "
        "model.context_length + 1 = 65, so val/loss/tiny would read 0; prepare it with a larger data.val_fraction or "
        "more text, or lower model.context_length"
    )
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_weight_of_0_validates_on_a_source_it_never_draws(make_cfg, two_sources):
    """The fix the too-small weight's line offers: 0 is never drawn, scored on its own, and left out of val/loss."""
    metrics, objects = train(
        make_cfg(
            sources(two_sources, big=1, small=0),
            "trainer.max_steps=4",
            "trainer.val_check_interval=4",
            "optim.warmup_steps=1",
        )
    )
    dm = objects["datamodule"]
    trained = {dm.window_location(w)["source"] for step in range(4) for w in dm._train_sampler.batch_windows(step)}
    assert trained == {"big"} and metrics["val/loss/small"] > 0
    assert metrics["val/loss"] == pytest.approx(metrics["val/loss/big"], rel=1e-6)


def test_sources_with_different_tokenizers_are_refused(make_cfg, two_sources, tmp_path):
    other = tmp_path / "bpe"
    prepare(input=None, out_dir=other, tokenizer="bpe", max_bytes=60_000, val_fraction=0.05, progress=False)
    spec = f"data.sources={{big: {{dir: {two_sources['big']}, weight: 1}}, code: {{dir: {other}, weight: 1}}}}"
    with pytest.raises(DataError, match=r"differs from .*; prepare every source with one tokenizer"):
        train(make_cfg(spec, "data.tokenizer=null"))


def test_doctor_shows_each_source(make_cfg, two_sources):
    from steadylm.doctor.data_checks import data_checks

    rows, batch = data_checks(make_cfg(sources(two_sources)), deep=False)
    names = [r.name for r in rows]
    assert "data: shards (big)" in names and "data: shards (small)" in names and batch is not None
    row = next(r for r in rows if r.name == "data: sources")
    assert "data.sources.big: 70.0% of the tokens" in row.evidence and "data.sources.small: 30.0%" in row.evidence


def test_a_stream_cannot_be_a_source(make_cfg):
    from steadylm.config import compose
    from steadylm.derived import data_source
    from tests.conftest import TINY_OVERRIDES

    with pytest.raises(ConfigError, match=r"^data\.sources mixes prepared shard folders; data=hf_stream streams one"):
        data_source(compose([*TINY_OVERRIDES, "data=hf_stream", "data.name=json", "data.sources={a: {dir: x}}"]))


def test_a_rollback_under_a_mixture_keeps_its_skipped_batches_skipped(make_cfg, two_sources, tmp_path):
    """A NaN weight at step 6 rolls back to step 4; the loader goes on from batch 8, so the mixture's batches 4..7
    are not trained again (every batch index once, in order)."""
    import lightning as L

    from steadylm.stability import read_events
    from tests.helpers import FAST, faults, fit

    class Batches(L.Callback):
        def __init__(self):
            self.seen = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.seen.append(batch_idx)

    batches = Batches()
    cfg = make_cfg(
        *FAST,
        sources(two_sources),
        "callbacks.stability.guard.max_consecutive=2",
        faults({"kind": "nan_weight", "step": 6, "param": "blocks.1.mlp.fc.weight"}),
    )
    fit(cfg, batches)
    rollback = [e for e in read_events(tmp_path / "run") if e["kind"] == "rollback"]
    assert len(rollback) == 1 and rollback[0]["detail"]["to_step"] == 4
    assert batches.seen == list(range(12))


def test_a_mixture_checkpoint_resumes_on_another_number_of_ranks():
    """2 ranks x 4 windows wrote the checkpoint after 5 steps; 1 rank x 8 continues at the next window of the stream."""
    order = lambda: MixtureOrder([5_000, 300], [0.6, 0.4], seed=4)  # noqa: E731
    two = [MixtureBatchSampler(order(), 4, world_size=2, rank=r) for r in (0, 1)]
    state = {"epoch": 0, "batches_done": 5, **two[0].shape()}
    one = MixtureBatchSampler(order(), 8, world_size=1)
    one.load_state_dict(state)
    first = next(iter(one))
    assert sorted(first) == sorted(two[0].batch_windows(5) + two[1].batch_windows(5))


def test_a_resume_between_one_source_and_a_mixture_says_where_it_goes_on(caplog):
    """A checkpoint of data.sources resumed on one data.dir, and one of a data.dir resumed under data.sources: each
    says in one line that it goes on at the checkpoint's position of its own order."""
    from steadylm.data.sampler import EpochBatchSampler

    mixed = MixtureBatchSampler(MixtureOrder([5_000, 300], [0.6, 0.4], seed=4, names=["web", "code"]), 16)
    with caplog.at_level(logging.INFO, logger="steadylm"):
        EpochBatchSampler(5_300, 16).load_state_dict(mixed.state_at(0, 5, step=5))
        mixed.load_state_dict(EpochBatchSampler(5_300, 16).state_at(0, 7))
    assert [r.getMessage() for r in caplog.records] == [
        "resume: the checkpoint read data.sources (web, code); this run's one source goes on at window position 80 of "
        "epoch 0 of its own order, as if it had been read from step 0",
        "resume: the checkpoint records no data.sources (a run on one data.dir, or an older steadylm); the mixture "
        "goes on at its position 112 as if it had been read from step 0",
    ]


@pytest.mark.slow  # two `python train.py` runs, one of them 2 DDP processes on CPU (gloo): ~60 s
def test_a_mixture_on_two_processes_trains_and_scores_each_source_as_one_process_does(two_sources, tmp_path):
    """The same mixture on 1 rank and on 2 (8 windows a step either way): step k's windows are the same, each
    source's val loss (token-weighted, summed over ranks) agrees, and result.json carries them."""
    import json

    from tests.helpers import CLI_TINY, DDP_TWO_CPU, run_cli
    from tests.test_machine_size import _windows

    run = [
        *CLI_TINY,
        sources(two_sources),
        "data.global_batch_tokens=256",  # 1 x 4 x 2 micro-batches = 2 ranks x 4
        "trainer.max_steps=6",
        "trainer.val_check_interval=6",
        "trainer.precision=32-true",
        "data.val_windows=null",  # every val window of each source, on 1 rank or split over 2
        "+callbacks.windows._target_=test_machine_size.WindowLog",
    ]
    results = {}
    for ranks, trainer in ((1, ["trainer=cpu"]), (2, DDP_TWO_CPU)):
        out = tmp_path / f"ranks{ranks}"
        proc = run_cli(*trainer, *run, f"hydra.run.dir={out}", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        shares = [
            ln for ln in (proc.stdout + proc.stderr).splitlines() if "data.sources.big: 70.0% of the tokens" in ln
        ]
        assert len(shares) == 1, (proc.stdout + proc.stderr)[-3000:]  # rank 0 says it, once
        results[ranks] = json.loads((out / "result.json").read_text()), _windows(out)
    (one, one_windows), (two, two_windows) = results[1], results[2]
    assert two_windows == one_windows and len(one_windows) == 6
    assert set(two["val_loss_by_source"]) == {"big", "small"}
    for name, loss in one["val_loss_by_source"].items():
        assert two["val_loss_by_source"][name] == pytest.approx(loss, abs=1e-4), name
    assert two["val_loss"] == pytest.approx(one["val_loss"], abs=1e-4)
    by_source = two["val_loss_by_source"]
    assert two["val_loss"] == pytest.approx(0.7 * by_source["big"] + 0.3 * by_source["small"], rel=1e-6)


def test_the_lr_probe_reads_the_mixture_as_the_run_does(make_cfg, two_sources):
    """The probe's windows are the run's first windows of the stream (at the weights, not the sources' sizes)."""
    from steadylm.derived import data_source
    from steadylm.doctor.lr_probe import probe_windows

    dm = data_source(make_cfg(sources(two_sources, big=0.2, small=0.8)))
    ids = probe_windows(dm, 64)
    assert [dm.window_location(w)["source"] for w in ids].count("small") == round(0.8 * 64)  # by size: about 17 %
    sampler = MixtureBatchSampler(dm.order, 16)
    assert ids == [w for step in range(4) for w in sampler.batch_windows(step)]


def test_doctor_probes_the_mixture_with_documents_masked_apart(two_sources, tmp_path):
    from steadylm.config import compose
    from steadylm.doctor.lr_probe import check_lr_probe
    from steadylm.resolve import fill_derived

    overrides = ["model=tiny", "model.n_layer=1", "trainer=cpu", f"paths.output_dir={tmp_path}", sources(two_sources)]
    overrides += ["data.pack=doc", "probe.steps=4", "probe.batches=2", "probe.batch_size=4", "probe.max_context=32"]
    cfg = compose(overrides, config_name="doctor")
    fill_derived(cfg)
    (row,) = check_lr_probe(cfg)
    assert "4 steps of 4x32 tokens of data.sources (big 6, small 2 windows), documents masked apart" in row.evidence


def test_the_spike_suspects_name_the_source(make_cfg, two_sources):
    """Each rank ranks its own rows from its DataModule's `window_location`: under data.sources a row names the
    source beside shard and offsets; one source's rows stay as they were."""
    from types import SimpleNamespace

    from steadylm.derived import data_source
    from steadylm.stability.suspects import rank_suspects

    for spec, named in ((sources(two_sources), True), (None, False)):
        dm = data_source(make_cfg(*[spec] if spec else []))
        dm.train_dataloader()
        trainer = SimpleNamespace(datamodule=dm, global_rank=1)
        rows = rank_suspects(trainer, 7, (2,), [(0, 0, 2.0), (0, 3, 5.0)])
        ids = dm.window_ids(2)
        assert [r["window"] for r in rows] == [ids[3], ids[0]] and rows[0]["rank"] == 1
        for row in rows:
            where = dm.window_location(row["window"])
            assert (row["shard"], row["start"], row["end"]) == (where["shard"], where["start"], where["end"])
            assert row.get("source") == (where["source"] if named else None) and ("source" in row) == named
        if named:  # diagnose's finding names it too
            from steadylm.stability.spike import _worst

            assert f"(source {rows[0]['source']}, {rows[0]['shard']} tokens" in _worst(
                SimpleNamespace(suspects=rows), 7
            )
