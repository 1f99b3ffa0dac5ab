"""Continued pretraining from a Hugging Face folder (`model.init_from`): `prepare` with its tokenizer.json, real
training runs from it (the run's first val/loss is the imported model's own, logged at step 0), resume, doctor and
the one-line refusals. The folder is a tiny random GPT-2 saved by `transformers` (tests/test_import_hf.py), first
trained a little here and exported, so the model the suite watches starts at a low loss as a published one does."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from steadylm.config import compose
from steadylm.data.prepare import prepare
from steadylm.data.shards import read_shard_info
from steadylm.train import train
from tests.helpers import run_cli
from tests.test_bad_inputs import assert_one_clear_error, run_main
from tests.test_import_hf import make_folder

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

RUN = [
    "trainer=cpu",
    "trainer.precision=32-true",
    "data.batch_size=8",
    "data.val_windows=32",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "logger=csv",
]


def metrics(run: Path) -> list[dict]:
    (path,) = run.rglob("metrics.csv")
    return list(csv.DictReader(path.open()))


def val_losses(run: Path) -> dict[int, float]:
    return {int(r["step"]): float(r["val/loss"]) for r in metrics(run) if r.get("val/loss")}


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """(data folder, a trained model's Hugging Face folder, the run that trained it): the random GPT-2 trained 60
    steps on text prepared with its tokenizer, then exported, as a published model is a trained one."""
    root = tmp_path_factory.mktemp("continue")
    random = make_folder(root / "random", "gpt2")
    data = root / "data"
    prepare(input=None, out_dir=data, tokenizer=str(random), max_bytes=200_000, val_fraction=0.05, progress=False)
    first = root / "first"
    steps = ["trainer.max_steps=60", "optim.lr=3e-3", "trainer.val_check_interval=60"]
    train(compose([*RUN, *steps, f"model.init_from={random}", f"data.dir={data}", f"paths.output_dir={first}"]))
    from steadylm.export import main as export

    export([f"ckpt={first / 'checkpoints' / 'last.ckpt'}", f"out={root / 'trained'}"])
    return data, root / "trained", first, random


def test_prepare_encodes_with_the_folders_tokenizer_and_the_shards_record_it(published):
    data, _, _, random = published
    info = read_shard_info(sorted(data.glob("train-*.h5"))[0])
    assert info.tokenizer == str(random)
    assert json.loads((data / "tokenizer.json").read_text()) == json.loads((random / "tokenizer.json").read_text())
    assert info.vocab_size == json.loads((random / "config.json").read_text())["vocab_size"]


def test_a_continued_run_logs_the_imported_models_loss_at_step_0_and_no_check_alarms(published, tmp_path, capsys):
    """The recipe (experiment=continue) from the trained model: its val/loss at step 0 is the one the run that made
    it ended with (the same weights on the same val batches), well below ln(V), and the full stability suite,
    watching from there, records no event; the loss then goes below the number to beat."""
    data, trained, first, _ = published
    run = tmp_path / "run"
    args = ["experiment=continue", "optim.lr=1e-3", "trainer.max_steps=40", "trainer.val_check_interval=40"]
    metrics_, _ = train(
        compose([*RUN, *args, f"model.init_from={trained}", f"data.dir={data}", f"paths.output_dir={run}"])
    )
    start, made = val_losses(run)[0], val_losses(first)[59]  # Lightning logs the last step's validation at 59
    assert start == pytest.approx(made, abs=1e-5)
    assert start < 0.85 * math.log(json.loads((trained / "config.json").read_text())["vocab_size"])
    assert metrics_["val/loss"] < start
    events = run / "stability" / "events.jsonl"
    assert not events.exists() or events.read_text() == ""
    from steadylm.generate import main as generate  # the worked example's last step: the run's checkpoint samples

    capsys.readouterr()  # the run's own console
    generate([f"ckpt={run / 'checkpoints' / 'last.ckpt'}", "prompt='def '", "temperature=0", "max_new_tokens=8"])
    assert capsys.readouterr().out.startswith("def ")


def test_resume_auto_continues_an_imported_run_from_its_own_checkpoint(published, tmp_path):
    data, trained, _, _ = published
    run = tmp_path / "run"
    common = [*RUN, f"model.init_from={trained}", f"data.dir={data}", f"paths.output_dir={run}"]
    common += ["optim.total_steps=20", "optim.warmup_steps=2"]
    train(compose([*common, "trainer.max_steps=10", "trainer.val_check_interval=10"]))
    assert 0 in val_losses(run)
    _, objects = train(compose([*common, "trainer.max_steps=20", "trainer.val_check_interval=10", "resume=auto"]))
    assert objects["trainer"].global_step == 20
    assert objects["module"].weights_from == str(trained)
    assert min(int(r["step"]) for r in metrics(run)) >= 9  # from its own checkpoint at 10: no second step 0


def test_doctor_and_its_lr_probe_run_on_an_imported_model(published, tmp_path, capsys):
    from steadylm.doctor.cli import main

    data, trained, _, _ = published
    args = ["trainer=cpu", "trainer.precision=32-true", f"model.init_from={trained}", f"data.dir={data}"]
    probe = ["probe.steps=8", "probe.batches=2", "probe.batch_size=4", f"out={tmp_path}"]
    main([*args, *probe])  # exits only when a check fails
    out = capsys.readouterr().out
    assert "model: initial loss" in out and f"the weights of {trained}, not an init" in out
    assert "on the model itself" in out, out  # the probe trained the imported weights, not a fresh proxy


@pytest.mark.parametrize(
    "extra, pattern",
    [
        (["model.n_layer=3"], r"model\.n_layer=3 contradicts model\.init_from=.*, whose config\.json gives 2"),
        (["model.context_length=128"], r"model\.context_length=128 contradicts .* may only be lowered"),
        (["model.parametrization=mup"], r"model\.parametrization=mup cannot start from model\.init_from="),
        (["init_from=x.ckpt"], r"both init_from=x\.ckpt and model\.init_from=.* are set"),
    ],
)
def test_a_model_key_against_the_checkpoint_is_refused_in_one_line(
    published, tmp_path, monkeypatch, capsys, extra, pattern
):
    data, trained, _, _ = published
    args = [*RUN, f"model.init_from={trained}", f"data.dir={data}", f"hydra.run.dir={tmp_path / 'run'}", *extra]
    assert_one_clear_error(*run_main(monkeypatch, capsys, *args), pattern)


def test_shards_of_another_tokenizer_are_refused_in_one_line(published, shards_dir, tmp_path, monkeypatch, capsys):
    _, trained, _, _ = published
    args = [*RUN, f"model.init_from={trained}", f"data.dir={shards_dir}", f"hydra.run.dir={tmp_path / 'run'}"]
    code, err = run_main(monkeypatch, capsys, *args)
    # the bytes shards' 257 ids fit this vocabulary: the tokenizer is what tells them apart
    assert_one_clear_error(code, err, r"reads ids of its tokenizer\.json, but the data was tokenized by 'bytes'")


def test_a_lower_context_length_trains_on_the_first_positions(published, tmp_path):
    data, trained, _, _ = published
    cfg = compose([*RUN, "model.context_length=32", "trainer.max_steps=2", f"model.init_from={trained}",
                   f"data.dir={data}", f"paths.output_dir={tmp_path}"])  # fmt: skip
    _, objects = train(cfg)
    assert objects["module"].net.wpe.weight.shape[0] == 32


def test_a_sweep_over_an_imported_model_and_diagnose_of_its_jobs(published, tmp_path, capsys):
    """`-m` over the LR from the trained model (real Hydra multirun, one process a job): every job starts at the
    imported model's loss (its step-0 val/loss), ends ok, and `diagnose` reads a job's folder as any run's."""
    from steadylm.diagnose.cli import main as diagnose

    data, trained, first, _ = published
    steps = ["trainer.max_steps=6", "trainer.val_check_interval=6", "optim.warmup_steps=1"]
    proc = run_cli(
        "-m", *RUN, "optim.lr=3e-4,1e-3", *steps, f"model.init_from={trained}", f"data.dir={data}", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = next((tmp_path / "logs" / "train" / "multiruns").iterdir())
    made = val_losses(first)[59]
    for job in ("0", "1"):
        assert json.loads((sweep / job / "result.json").read_text())["status"] == "ok"
        assert val_losses(sweep / job)[0] == pytest.approx(made, abs=1e-5)
    diagnose([str(sweep / "0")])
    assert capsys.readouterr().out.startswith("no instability found\nreport: ")


def test_doctor_refuses_a_model_key_against_the_checkpoint_in_one_line(published, capsys):
    from steadylm.doctor.cli import main

    data, trained, _, _ = published
    with pytest.raises(SystemExit) as exit_info:
        main(["trainer=cpu", f"model.init_from={trained}", f"data.dir={data}", "model.d_model=64"])
    assert_one_clear_error(
        exit_info.value.code, capsys.readouterr().err, r"model\.d_model=64 contradicts model\.init_from"
    )


def test_data_whose_ids_do_not_fit_the_embedding_is_refused_in_one_line(shards_dir, tmp_path, monkeypatch, capsys):
    """A folder without a tokenizer.json is trusted to the vocabulary check alone: the bytes shards' 257 ids do not
    fit a 200-row embedding."""
    import transformers

    folder = tmp_path / "small-vocab"
    # token ids inside the 200 rows: GPT-2's defaults (50256) would make transformers warn through its logger
    config = transformers.GPT2Config(
        vocab_size=200, n_embd=16, n_layer=1, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    args = [*RUN, f"model.init_from={folder}", f"data.dir={shards_dir}", f"hydra.run.dir={tmp_path / 'run'}"]
    code, err = run_main(monkeypatch, capsys, *args)
    assert_one_clear_error(code, err, r"shard vocab_size 257 exceeds model\.vocab_size 200; .*model\.init_from")


def test_init_from_given_a_model_folder_points_to_model_init_from(published, tmp_path, monkeypatch, capsys):
    data, trained, _, _ = published
    args = [*RUN, "trainer.max_steps=2", f"init_from={trained}", f"data.dir={data}", f"hydra.run.dir={tmp_path / 'r'}"]
    code, err = run_main(monkeypatch, capsys, *args)
    assert_one_clear_error(code, err, r"init_from=.* is a folder: .* is model\.init_from=")
