"""`data=hf_stream`: local files streamed through `datasets` (no network) train, resume exactly and refuse in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from steadylm.checkpointing import safe_load
from steadylm.config import compose
from steadylm.data.stream import StreamDataModule
from steadylm.derived import data_source
from steadylm.errors import ConfigError, DataError
from steadylm.resolve import fill_derived
from steadylm.train import train

from .conftest import TINY_OVERRIDES
from .helpers import run_cli

pytest.importorskip("datasets")
os.environ["HF_DATASETS_OFFLINE"] = "1"  # a hub name must fail here, not reach out

K = 6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """400 JSON-lines documents, each with a `text` and an `id` field."""
    path = tmp_path_factory.mktemp("stream") / "docs.jsonl"
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly box jugs".split()
    with path.open("w") as f:
        for i in range(400):
            text = " ".join(words[(i * 7 + j) % len(words)] for j in range(20 + i % 30))
            f.write(json.dumps({"text": f"{i}. {text}.", "id": i}) + "\n")
    return path


def stream_cfg(corpus: Path, out: Path, *overrides: str):
    cfg = compose(
        [
            *TINY_OVERRIDES,
            "data=hf_stream",
            "data.name=json",
            f"data.data_files=[{corpus}]",
            "data.val_windows=16",
            f"paths.output_dir={out}",
            *overrides,
        ]
    )
    fill_derived(cfg)
    return cfg


def test_fill_derived_asks_the_stream_for_vocabulary_and_tokenizer(corpus, tmp_path):
    cfg = stream_cfg(corpus, tmp_path)
    assert cfg.model.vocab_size == 320 and cfg.data.tokenizer == "bytes"  # 257 bytes ids, padded to 64


def test_stream_trains_and_reports_bits_per_byte(corpus, tmp_path):
    metrics, objects = train(stream_cfg(corpus, tmp_path / "run", "trainer.max_steps=20"))
    assert objects["trainer"].global_step == 20
    assert metrics["val/loss"] < 5.0  # ln(320) = 5.77 at chance
    assert objects["datamodule"].bytes_per_token == pytest.approx(1.0, abs=0.05)  # bytes: one per token, EOS aside
    assert "val/bpb" in metrics


def test_window_ids_follow_the_stream_and_its_resume_skip(corpus):
    dm = StreamDataModule("json", data_files=[str(corpus)], context_length=16, batch_size=4, val_windows=8)
    dm.setup("fit")
    batches = iter(dm.train_dataloader())
    first, second = next(batches), next(batches)
    assert dm.window_ids(1) == [4, 5, 6, 7]
    dm.load_state_dict({"batches_done": 1})  # one batch trained: a resume starts at window 4
    x, y = next(iter(dm.train_dataloader()))
    assert torch.equal(x, second[0]) and torch.equal(y, second[1]) and not torch.equal(x, first[0])
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one token
    assert dm.window_location(4) == {}


SHAPE = {"global_batch": 8, "step_batches": 1}  # what a count means: windows per micro-batch, micro-batches a step


def test_k_plus_resume_plus_k_equals_2k_bitwise(corpus, tmp_path):
    common = ["model.dropout=0.1", f"optim.total_steps={2 * K}", "trainer.val_check_interval=3"]
    common += ["callbacks.checkpoint.every_n_train_steps=3"]
    full, split = tmp_path / "full", tmp_path / "split"
    train(stream_cfg(corpus, full, *common, f"trainer.max_steps={2 * K}"))
    train(stream_cfg(corpus, split, *common, f"trainer.max_steps={K}"))
    assert safe_load(split / "checkpoints" / "last.ckpt")["StreamDataModule"] == {"batches_done": K, **SHAPE}
    train(stream_cfg(corpus, split, *common, f"trainer.max_steps={2 * K}", "resume=auto"))
    a, b = safe_load(full / "checkpoints" / "last.ckpt"), safe_load(split / "checkpoints" / "last.ckpt")
    assert b["global_step"] == 2 * K and b["StreamDataModule"] == {"batches_done": 2 * K, **SHAPE}
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])


def test_resume_that_rereads_the_first_windows_differs(corpus, tmp_path):
    """The control: forgetting the stream position (batches_done=0) trains on other windows after the resume."""
    dm = StreamDataModule("json", data_files=[str(corpus)], context_length=16, batch_size=4, val_windows=8)
    dm.load_state_dict({"batches_done": 3})
    resumed = next(iter(dm.train_dataloader()))[0]
    dm.load_state_dict({"batches_done": 0})
    assert not torch.equal(resumed, next(iter(dm.train_dataloader()))[0])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.name=/nonexistent/folder", "data.data_files=null"], r"data\.name=/nonexistent/folder: no such dataset"),
        (["data.name=nobody/no-such-dataset", "data.data_files=null"], r"no-such-dataset: no such dataset"),
        (["data.split=validation"], r"no split 'validation' \(data\.split\)"),
        (["data.text_field=body"], r"row 0 has no string field 'body' \(data\.text_field\); its fields are text, id"),
    ],
)
def test_missing_dataset_split_or_field_is_one_data_error(corpus, tmp_path, overrides, message):
    cfg = compose([*TINY_OVERRIDES, "data=hf_stream", "data.name=json", f"data.data_files=[{corpus}]", *overrides])
    with pytest.raises(DataError, match=message):
        data_source(cfg)


def test_missing_config_is_one_data_error(corpus, tmp_path):
    folder = tmp_path / "ds"
    (folder / "small").mkdir(parents=True)
    (folder / "small" / "docs.jsonl").write_text(corpus.read_text())
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: small\n  data_files:\n  - split: train\n    path: small/*.jsonl\n---\n"
    )
    assert data_source(compose(["data=hf_stream", f"data.name={folder}", "data.config=small"])).vocab_size == 257
    with pytest.raises(DataError, match=r"data\.config=big: no config 'big' \(data\.config\)"):
        data_source(compose(["data=hf_stream", f"data.name={folder}", "data.config=big"]))


def test_a_missing_name_is_one_config_error():
    with pytest.raises(ConfigError, match=r"^data\.name is required by this data config: set data\.name=\.\.\.$"):
        data_source(compose(["data=hf_stream"]))


def test_workers_are_refused_in_one_line(corpus):
    with pytest.raises(ConfigError, match=r"data\.num_workers=2: data=hf_stream reads in the training process"):
        data_source(compose(["data=hf_stream", "data.name=json", f"data.data_files=[{corpus}]", "data.num_workers=2"]))


def test_train_py_prints_one_line_and_exits_2_for_a_missing_split(corpus, tmp_path):
    proc = run_cli(
        "trainer=cpu", "data=hf_stream", "data.name=json", f"data.data_files=[{corpus}]", "data.split=test",
        cwd=tmp_path, env={"HF_DATASETS_OFFLINE": "1"},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "no split 'test' (data.split)" in lines[0] and "Traceback" not in proc.stderr


def test_doctor_checks_a_stream_without_data_dir(corpus, tmp_path):
    from steadylm.doctor.cli import run_checks

    rows = {r.name: r for r in run_checks(stream_cfg(corpus, tmp_path / "run"), out_dir=tmp_path / "doc")}
    fits = rows["data: fits the model"]
    assert not fits.failed and "data vocab 257 <= model.vocab_size 320, tokenizer bytes" in fits.evidence
    assert "data: shards" not in rows and not rows["model: build"].failed


def test_the_lr_probe_takes_its_batches_from_a_stream_in_order(corpus, tmp_path):
    from steadylm.doctor.lr_probe import probe_batches

    batches = probe_batches(stream_cfg(corpus, tmp_path / "run"), context=16, n=3, batch_size=2)
    assert len(batches) == 3
    for x, y in batches:
        assert x.shape == y.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])  # next-token pairs


def test_pack_doc_masks_the_stream_at_its_tokenizers_end_of_text(corpus):
    base = [*TINY_OVERRIDES, "data=hf_stream", "data.name=json", f"data.data_files=[{corpus}]"]
    assert data_source(compose([*base, "data.pack=doc"])).document_separator == 256  # bytes: end-of-text 256
    assert data_source(compose(base)).document_separator is None
    with pytest.raises(ConfigError, match=r"^data\.pack='window' is not allowed; it must be none or doc"):
        data_source(compose([*base, "data.pack=window"]))
