"""`data.align=doc` on real HDF5 shards: every train window starts at a document boundary or T after the previous
window of its document, a document's last window is padded instead of running on, every target of every shard is
predicted exactly once per epoch across ranks; `none` keeps today's windows; val stays as it is."""

from __future__ import annotations

import logging
import pickle

import numpy as np
import pytest
import torch

from steadylm.config import compose, validate_config
from steadylm.data.datamodule import ShardDataModule
from steadylm.data.dataset import TokenWindows
from steadylm.data.prepare import write_shard
from steadylm.data.sampler import EpochBatchSampler
from steadylm.derived import data_source
from steadylm.errors import ConfigError
from tests.helpers import CLI_TINY, run_cli

T, EOS = 16, 256
# Document lengths per shard: empty documents (eos after eos), lengths T - 1, T, T + 1, several T, and shard 0
# opening with an eos; shard 1 ends inside a document (no final eos), as a shard cut mid-document does.
DOCS = [[0, 5, 16, 15, 17, 0, 0, 40, 1], [33, 2, 64, 9], [7, 7, 7, 100]]


def _doc_shards(d, split="train", docs=DOCS):
    d.mkdir(parents=True, exist_ok=True)
    rng, paths, arrays = np.random.default_rng(len(split)), [], []
    for i, lengths in enumerate(docs):
        arr = np.concatenate([np.append(rng.integers(0, EOS, n), EOS) for n in lengths])
        arr = arr[:-1] if i == 1 else arr
        paths.append(d / f"{split}-{i:05d}.h5")
        write_shard(paths[-1], arr, vocab_size=257, eos_id=EOS, tokenizer="bytes")
        arrays.append(arr)
    return paths, arrays


def _covered(ds, arrays, windows) -> list[np.ndarray]:
    """How often each token of each shard is a (non-ignored) target of `windows`."""
    seen = [np.zeros(len(a), np.int64) for a in arrays]
    for i in windows:
        s, start, k = ds.locate(i)
        seen[s][start + 1 : start + k + 1] += 1
    return seen


def test_doc_windows_start_at_a_boundary_or_T_after_the_last_and_pad_the_document_end(tmp_path):
    paths, arrays = _doc_shards(tmp_path)
    ds = TokenWindows(paths, T, align="doc")
    previous = {}  # shard -> the start of its previous window
    for i in range(len(ds)):
        (x, y), (s, start, k) = ds[i], ds.locate(i)
        a = arrays[s]
        assert 1 <= k <= T and x.shape == y.shape == (T,)
        assert (
            x[:k].tolist() == a[start : start + k].tolist() and y[:k].tolist() == a[start + 1 : start + k + 1].tolist()
        )
        assert (y[k:] == -100).all()  # the padded tail is ignored by the loss
        assert EOS not in a[start + 1 : start + k].tolist()  # never runs past its document's end
        if start == 0 or a[start] == EOS:  # the shard's start, or the previous document's eos (its BOS)
            assert start not in previous.values()
        else:  # a continuation: T after the previous window of the same document, which was full
            assert previous[s] == start - T and EOS not in a[start - T + 1 : start + 1].tolist()
        if k < T:  # only a document's last window is short: it ends on an eos or the shard's last token
            assert a[start + k] == EOS or start + k == len(a) - 1
        previous[s] = start
    # every target 1 .. n - 1 of every shard exactly once; the padding is what the layout reports
    assert all((c[1:] == 1).all() and c[0] == 0 for c in _covered(ds, arrays, range(len(ds))))
    real = sum(len(a) - 1 for a in arrays)
    assert ds.docs.padding == pytest.approx(1 - real / (len(ds) * T)) and 0 < ds.docs.padding < 0.5
    assert ds.docs.counts == [12, 10, 10]  # per document: ceil(targets / T), hand-counted from DOCS


@pytest.mark.parametrize("W,B", [(1, 4), (2, 3), (3, 5)])
def test_an_epoch_across_ranks_covers_every_token_once(tmp_path, W, B):
    paths, arrays = _doc_shards(tmp_path)
    ds = TokenWindows(paths, T, align="doc")
    clone = pickle.loads(pickle.dumps(ds))  # what a worker process or another rank holds: the same layout
    assert [clone.locate(i) for i in range(len(ds))] == [ds.locate(i) for i in range(len(ds))]
    for epoch in range(2):
        windows = []
        for rank in range(W):
            s = EpochBatchSampler(len(ds), B, rank=rank, world_size=W, seed=5)
            s.set_epoch(epoch)
            windows += [i for batch in s for i in batch if i != -1]
        assert sorted(windows) == list(range(len(ds)))
        assert all((c[1:] == 1).all() for c in _covered(ds, arrays, windows))


def test_align_none_keeps_the_windows_of_every_T_tokens(tmp_path):
    paths, arrays = _doc_shards(tmp_path)
    ds = TokenWindows(paths, T)
    assert ds.docs is None and len(ds) == sum((len(a) - 1) // T for a in arrays)
    expected = [a[i * T : i * T + T + 1] for a in arrays for i in range((len(a) - 1) // T)]
    for i, w in enumerate(expected):
        x, y = ds[i]
        assert x.tolist() == w[:-1].tolist() and y.tolist() == w[1:].tolist()


def test_datamodule_aligns_train_only_logs_the_padding_and_resumes(tmp_path, caplog):
    _doc_shards(tmp_path, "train")
    _doc_shards(tmp_path, "val", [[50, 3, 80]])
    plain = ShardDataModule(tmp_path, batch_size=4, context_length=T)
    with caplog.at_level(logging.INFO, logger="steadylm"):
        dm = ShardDataModule(tmp_path, batch_size=4, context_length=T, align="doc")
        dm.setup("fit")
    assert dm.train_set.docs is not None and dm.val_set.docs is None  # val windows as without the switch
    assert [dm.val_set.locate(i) for i in range(len(dm.val_set))] == [
        plain.val_set.locate(i) for i in range(len(plain.setup("fit") or plain.val_set))
    ]
    pct = f"{100 * dm.train_set.docs.padding:.1f}%"
    assert [r.getMessage() for r in caplog.records] == [
        f"data.align=doc: 32 train windows over 16 document segments at T=16, {pct} of their targets are padding"
    ]
    s, start, k = dm.train_set.locate(9)
    assert dm.window_location(9) == {
        "shard": f"train-{s:05d}.h5",
        "shard_path": str(tmp_path / f"train-{s:05d}.h5"),
        "start": start,
        "end": start + k + 1,
    }
    full = list(dm.train_dataloader())
    it = iter(dm.train_dataloader())
    for _ in range(3):
        next(it)
    again = ShardDataModule(tmp_path, batch_size=4, context_length=T, align="doc")
    again.load_state_dict(dm.state_dict())
    rest = list(again.train_dataloader())
    assert len(rest) == len(full) - 3
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(rest, full[3:]))


def test_a_bad_align_is_one_config_error_and_a_stream_refuses_doc(tmp_path):
    with pytest.raises(ConfigError, match=r"^data\.align='docs' is not allowed; it must be none \(a window every"):
        validate_config(compose(["data.align=docs", "model.vocab_size=320", f"paths.output_dir={tmp_path}"]))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "hello"}\n')
    stream = ["data=hf_stream", "data.name=json", f"data.data_files=[{corpus}]", "data.align=doc"]
    with pytest.raises(ConfigError, match=r"^data\.align=doc: data=hf_stream packs the stream as it comes"):
        data_source(compose(stream))


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2: DDP on CPU, ~30 s
def test_train_py_fits_with_doc_windows(shards_dir, tmp_path, ranks):
    proc = run_cli(
        "trainer=cpu" if ranks == 1 else "trainer=ddp_sim",
        *CLI_TINY,
        "trainer.max_steps=3",
        "data.val_windows=4",
        "logger=none",
        f"data.dir={shards_dir}",
        "data.align=doc",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "data.align=doc: " in ln]
    assert lines and all("document segments at T=32" in ln for ln in lines), proc.stderr[-3000:]
    assert len({ln[ln.index("data.align") :] for ln in lines}) == 1  # every rank: the same layout
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()
