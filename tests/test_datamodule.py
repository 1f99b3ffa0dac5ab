import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from steadylm.data.datamodule import ShardDataModule
from steadylm.data.dataset import TokenWindows
from steadylm.data.prepare import write_shard
from steadylm.data.sampler import EpochBatchSampler
from steadylm.errors import DataError

BYTES = dict(vocab_size=257, eos_id=256, tokenizer="bytes")


def _make_shards(d, sizes, split="train", **attrs):
    d.mkdir(parents=True, exist_ok=True)
    kw = {**BYTES, **attrs}
    paths, arrays = [], []
    for i, n in enumerate(sizes):
        # Token value encodes position so windows can be checked for contiguity.
        arr = (np.arange(n) + 1000 * i) % (kw["vocab_size"] - 1)
        p = d / f"{split}-{i:05d}.h5"
        write_shard(p, arr, **kw)
        paths.append(p)
        arrays.append(arr)
    return paths, arrays


# --- sampler --------------------------------------------------------------------------------


def _epoch(n, B, W, **kw):
    samplers = [EpochBatchSampler(n, B, rank=r, world_size=W, **kw) for r in range(W)]
    return [list(s) for s in samplers], samplers


@pytest.mark.parametrize("n,B,W", [(23, 4, 1), (23, 4, 2), (8, 4, 2), (5, 4, 2), (1, 3, 2), (100, 7, 3)])
def test_epoch_covers_every_window_once(n, B, W):
    per_rank, samplers = _epoch(n, B, W, seed=3)
    counts = {len(b) for b in per_rank}
    assert len(counts) == 1 and counts.pop() == len(samplers[0])  # same number of batches per rank
    assert all(len(batch) == B for batches in per_rank for batch in batches)  # static shapes
    seen = [i for batches in per_rank for batch in batches for i in batch if i != -1]
    assert sorted(seen) == list(range(n))  # union is everything, no duplicates => disjoint
    sets = [{i for batch in b for i in batch if i != -1} for b in per_rank]
    assert sum(map(len, sets)) == n


def test_drop_last_drops_only_partial_global_batch():
    per_rank, samplers = _epoch(23, 4, 2, drop_last=True)
    assert len(samplers[0]) == 2
    seen = [i for b in per_rank for batch in b for i in batch]
    assert -1 not in seen and len(set(seen)) == 16


@pytest.mark.slow  # `python train.py` to its refusal: ~8 s
def test_drop_last_with_an_epoch_shorter_than_one_step_is_one_line(shards_dir, tmp_path):
    """4,000 micro-batches of 4 windows a step (from data.global_batch_tokens) against the ~11,500 windows of the
    shards: with drop_last no step would run (Lightning: "No training batches"); refused at startup, exit 2."""
    from tests.helpers import CLI_TINY, run_cli

    step = "data.global_batch_tokens=512000"  # 4 x 32 tokens x 4,000
    proc = run_cli(*CLI_TINY, "trainer=cpu", f"data.dir={shards_dir}", "data.drop_last=true", step, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: data.drop_last=true drops an epoch's last partial optimizer step, and the ")
    windows = int(proc.stderr.split("and the ")[1].split(" train windows")[0].replace(",", ""))
    assert 10_000 < windows < 16_000
    assert (
        "fewer than one step's 16,000 (data.batch_size=4 x 1 device(s) x trainer.accumulate_grad_batches=4000 from "
        "data.global_batch_tokens=512000), so no step would run; set data.drop_last=false, or lower data.batch_size "
        "or data.global_batch_tokens" in proc.stderr
    )
    assert not list(tmp_path.rglob("*.ckpt"))


def test_drop_last_names_the_accumulation_it_was_given(make_cfg):
    from steadylm.errors import ConfigError
    from steadylm.train import train

    with pytest.raises(
        ConfigError,
        match=r"x trainer\.accumulate_grad_batches=1000\), so no step would run; .* or "
        r"lower data\.batch_size or trainer\.accumulate_grad_batches$",
    ):
        train(make_cfg("data.drop_last=true", "trainer.accumulate_grad_batches=1000"))
    metrics, objects = train(
        make_cfg(
            "data.drop_last=true", "trainer.accumulate_grad_batches=2", "trainer.max_steps=2", "optim.warmup_steps=1"
        )
    )
    assert objects["trainer"].global_step == 2  # an epoch of whole steps: it trains


def test_deterministic_and_epochs_differ():
    a = list(EpochBatchSampler(50, 5, seed=7))
    b = list(EpochBatchSampler(50, 5, seed=7))
    assert a == b
    s = EpochBatchSampler(50, 5, seed=7)
    s.set_epoch(1)
    assert list(s) != a
    assert list(EpochBatchSampler(50, 5, seed=8)) != a
    assert [i for b in EpochBatchSampler(10, 3, shuffle=False) for i in b] == list(range(10)) + [-1, -1]


def test_resume_mid_epoch_yields_remaining_batches():
    full = list(EpochBatchSampler(40, 3, seed=1, rank=1, world_size=2))
    s = EpochBatchSampler(40, 3, seed=1, rank=1, world_size=2)
    s.set_epoch(0)
    it = iter(s)
    first = [next(it) for _ in range(3)]
    state = s.state_dict()
    assert state == {"epoch": 0, "batches_done": 3, "global_batch": 6, "step_batches": 1}  # the count and its shape
    r = EpochBatchSampler(40, 3, seed=1, rank=1, world_size=2)
    r.load_state_dict(state)
    r.set_epoch(0)  # Lightning calls this at the start of the resumed epoch: must not reset
    assert first + list(r) == full
    assert list(r) == full  # the skip happens once, then whole epochs again
    r.load_state_dict({"epoch": 2, "batches_done": 1})
    e2 = EpochBatchSampler(40, 3, seed=1, rank=1, world_size=2)
    e2.set_epoch(2)
    assert list(r) == list(e2)[1:] and r.epoch == 2


# --- dataset --------------------------------------------------------------------------------


def test_windows_are_contiguous_and_never_cross_shards(tmp_path):
    T = 16
    paths, arrays = _make_shards(tmp_path, [100, 17, 16, 50])  # 6, 1, 0, 3 windows
    ds = TokenWindows(paths, T)
    assert len(ds) == 6 + 1 + 0 + 3
    expected = [arr[i * T : i * T + T + 1] for arr in arrays for i in range((len(arr) - 1) // T)]
    for i, w in enumerate(expected):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (T,)
        assert torch.equal(x, torch.from_numpy(w[:-1])) and torch.equal(y, torch.from_numpy(w[1:]))
        assert torch.equal(x[1:], y[:-1])
    x, y = ds[-1]
    assert torch.equal(x, torch.zeros(T, dtype=torch.int64)) and torch.equal(y, torch.full((T,), -100))
    with pytest.raises(IndexError):
        ds[len(ds)]
    assert len(ds.__getitems__([0, -1, 3])) == 3


def test_dataset_pickles_without_handles(tmp_path):
    paths, _ = _make_shards(tmp_path, [200])
    ds = TokenWindows(paths, 8)
    x0, _ = ds[0]  # opens a handle in this process
    assert ds._handles
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._handles == {}
    assert torch.equal(clone[0][0], x0)


def test_dataloader_two_workers_covers_epoch(tmp_path):
    paths, _ = _make_shards(tmp_path, [300, 250])
    ds = TokenWindows(paths, 10)
    n = len(ds)
    sampler = EpochBatchSampler(n, 4, seed=0)
    ds[0]  # a handle opened in the parent must not leak into workers
    loader = DataLoader(ds, batch_sampler=sampler, num_workers=2, persistent_workers=True)
    xs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches = list(loader)
        assert len(batches) == len(sampler) and all(b[0].shape == (4, 10) for b in batches)
        xs.append(torch.cat([b[0] for b in batches]))
    expected = sorted(tuple(ds[i][0].tolist()) for i in range(n))
    pad = (0,) * 10
    for x in xs:
        rows = [tuple(r) for r in x.tolist()]
        assert sorted(r for r in rows if r != pad) == expected  # every window exactly once
        assert len(rows) - len(expected) == len(sampler) * 4 - n  # the rest is padding
    assert not torch.equal(xs[0], xs[1])


# --- datamodule -----------------------------------------------------------------------------


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "shards"
    _make_shards(d, [1000, 700])
    _make_shards(d, [300], split="val")
    return d


def test_datamodule_loaders_and_properties(data_dir):
    dm = ShardDataModule(data_dir, batch_size=4, context_length=32, model_vocab_size=320, tokenizer="bytes")
    dm.setup("fit")
    assert (dm.vocab_size, dm.infos["train"][0].eos_id, dm.tokenizer_name) == (257, 256, "bytes")
    assert sum(i.n_tokens for i in dm.infos["train"]) == 1700 and dm.n_train_windows == 999 // 32 + 699 // 32
    train = dm.train_dataloader()
    batches = list(train)
    assert len(batches) == -(-dm.n_train_windows // 4)
    x, y = batches[0]
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    val = list(dm.val_dataloader())
    assert len(val) == -(-(299 // 32) // 4)
    assert (val[-1][1] == -100).any()  # the final partial batch is padded, not dropped


def test_datamodule_state_resume(data_dir):
    dm = ShardDataModule(data_dir, batch_size=4, context_length=32)
    it = iter(dm.train_dataloader())
    seen = [next(it)[0] for _ in range(2)]
    state = dm.state_dict()
    assert state == {"train_sampler": {"epoch": 0, "batches_done": 2, "global_batch": 4, "step_batches": 1}}
    dm2 = ShardDataModule(data_dir, batch_size=4, context_length=32)
    dm2.load_state_dict(state)  # Lightning restores before building loaders
    rest = list(dm2.train_dataloader())
    full = list(ShardDataModule(data_dir, batch_size=4, context_length=32).train_dataloader())
    assert all(torch.equal(a, b[0]) for a, b in zip(seen + [r[0] for r in rest], full))
    assert len(rest) + 2 == len(full)


def test_refuses_model_vocab_too_small(data_dir):
    dm = ShardDataModule(data_dir, context_length=32, model_vocab_size=256)
    with pytest.raises(DataError, match=r"train-00000\.h5.*vocab_size 257 exceeds model\.vocab_size 256"):
        dm.setup("fit")


def test_refuses_context_too_long(data_dir):
    dm = ShardDataModule(data_dir, context_length=1000)
    with pytest.raises(DataError, match=r"train-00000\.h5.*1000 tokens.*model\.context_length \+ 1 = 1001"):
        dm.setup("fit")
    dm = ShardDataModule(data_dir, context_length=300)  # train fits, val (300 tokens) does not
    with pytest.raises(DataError, match=r"val-00000\.h5.*model\.context_length"):
        dm.setup("fit")


def test_refuses_tokenizer_mismatch(data_dir):
    with pytest.raises(DataError, match=r"train-00000\.h5.*tokenizer 'bytes'.*data\.tokenizer is 'gpt2'"):
        ShardDataModule(data_dir, context_length=32, tokenizer="gpt2").setup("fit")


def test_refuses_missing_dir(tmp_path):
    with pytest.raises(DataError, match=r"nowhere: data\.dir does not exist.*make data.*steadylm\.data\.prepare"):
        ShardDataModule(tmp_path / "nowhere").setup("fit")


def test_refuses_missing_val_split(tmp_path):
    _make_shards(tmp_path / "d", [100])
    with pytest.raises(DataError, match=r"d: no val shards"):
        ShardDataModule(tmp_path / "d", context_length=8).setup("fit")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: no train shards.*steadylm\.data\.prepare data\.dir="):
        ShardDataModule(tmp_path / "empty").setup("fit")


def test_refuses_bad_shard_through_setup(data_dir):
    bad = data_dir / "train-00001.h5"
    bad.write_bytes(bad.read_bytes()[:500])
    with pytest.raises(DataError, match=r"train-00001\.h5: not a readable HDF5 file"):
        ShardDataModule(data_dir, context_length=32).setup("fit")


def test_prepared_corpus_end_to_end(tmp_path):
    from steadylm.data.prepare import prepare

    out = tmp_path / "std"
    prepare(out_dir=out, max_bytes=100_000, val_fraction=0.2, progress=False)
    dm = ShardDataModule(out, batch_size=2, context_length=64, model_vocab_size=320)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 64) and int(x.max()) < 257


def test_lightning_fit_sets_epoch_and_keeps_sampler(data_dir):
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(257, 257)
            self.seen = []

        def training_step(self, batch, i):
            x, y = batch
            self.seen.append((self.current_epoch, x[:, 0].clone()))
            return torch.nn.functional.cross_entropy(self.emb(x).flatten(0, 1), y.flatten(), ignore_index=-100)

        def validation_step(self, batch, i):
            pass

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Snap(L.Callback):
        states = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.states[(trainer.current_epoch, batch_idx)] = trainer.datamodule.state_dict()["train_sampler"]

    dm = ShardDataModule(data_dir, batch_size=8, context_length=32)
    model = Tiny()
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Snap()],
    )
    trainer.fit(model, datamodule=dm)
    # What a checkpoint saved after batch i records: i + 1 batches consumed (not the prefetched count).
    shape = {"global_batch": 8, "step_batches": 1}
    assert Snap.states[(0, 2)] == {"epoch": 0, "batches_done": 3, **shape}
    assert Snap.states[(1, 0)] == {"epoch": 1, "batches_done": 1, **shape}
    per_epoch = [torch.cat([x for e, x in model.seen if e == k]) for k in (0, 1)]
    assert len(per_epoch[0]) == len(per_epoch[1]) == -(-dm.n_train_windows // 8) * 8
    assert not torch.equal(per_epoch[0], per_epoch[1])  # set_epoch reached our batch sampler
    assert dm.state_dict()["train_sampler"]["epoch"] == 1


# --- reading at scale ---------------------------------------------------------------------------------------


def test_feistel_permutation_is_a_bijection_for_awkward_sizes():
    from steadylm.data.sampler import FeistelPermutation

    for n in [1, 2, 3, 4, 5, 16, 17, 100, 1023, 1025, 4099]:
        p = FeistelPermutation(n, key=n * 7)(np.arange(n))
        assert sorted(p.tolist()) == list(range(n)), n
    a, b = FeistelPermutation(1000, 1)(np.arange(1000)), FeistelPermutation(1000, 2)(np.arange(1000))
    assert (a != b).mean() > 0.9  # keys give different orders
    assert abs(np.corrcoef(np.arange(1000), a)[0, 1]) < 0.1  # no visible trend with position


def test_batch_windows_is_what_iter_yields_and_global_windows_agree():
    for W in (1, 3):
        for r in range(W):
            s = EpochBatchSampler(101, 4, rank=r, world_size=W, seed=5)
            s.set_epoch(2)
            assert list(s) == [s.batch_windows(i) for i in range(len(s))]
            perm = s.global_windows(np.arange(len(s) * s.global_batch))
            assert [perm[i * s.global_batch : (i + 1) * s.global_batch][r::W].tolist() for i in range(len(s))] == list(
                s
            )


def test_index_over_a_billion_virtual_tokens_has_flat_memory_and_full_coverage():
    """1e9 tokens in 1,000 virtual shards: the index is O(shards), the epoch order O(1) per rank."""
    import tracemalloc
    from pathlib import Path

    from steadylm.data.shards import ShardInfo

    infos = [
        ShardInfo(Path(f"train-{i:05d}.h5"), 1_000_000, 50257, 50256, "gpt2", 50256, "uint16", 3_000_000)
        for i in range(1000)
    ]
    T = 1024
    tracemalloc.start()
    ds = TokenWindows([i.path for i in infos], T, infos=infos)
    samplers = [EpochBatchSampler(len(ds), 8, rank=r, world_size=4, seed=1) for r in range(4)]
    it = iter(samplers[0])
    first = [next(it) for _ in range(100)]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert sum(i.n_tokens for i in infos) == 10**9
    assert len(ds) == 1000 * ((1_000_000 - 1) // T)
    assert peak < 1_000_000, f"{peak:,} bytes traced: something holds O(windows) memory"
    # Coverage: every window exactly once across the 4 ranks, checked in blocks of global batches.
    s0 = samplers[0]
    seen = np.zeros(len(ds), dtype=np.uint8)
    G = s0.global_batch
    for start in range(0, len(s0) * G, 1 << 16):
        ids = s0.global_windows(np.arange(start, min(start + (1 << 16), len(s0) * G)))
        ids = ids[ids >= 0]
        np.add.at(seen, ids, 1)
    assert seen.min() == 1 and seen.max() == 1
    assert first[0] == samplers[0].batch_windows(0)
    # locate names the shard, token offset and real targets behind any window
    shard, start, targets = ds.locate(len(ds) - 1)
    assert ds.paths[shard].name == "train-00999.h5" and start + T + 1 <= 1_000_000 and targets == T


# --- every window checked as it is read ---------------------------------------------------------------------


def _poison(path, offset, value):
    import h5py

    with h5py.File(path, "r+") as f:
        f["tokens"][offset] = value  # the attrs still say all ids are in range: only reading finds it


def test_window_with_an_id_beyond_the_model_vocab_is_refused_naming_file_offset_id(tmp_path):
    paths, _ = _make_shards(tmp_path, [200, 300])
    _poison(paths[1], 77, 256)
    ds = TokenWindows(paths, 16, model_vocab_size=256)
    with pytest.raises(
        DataError, match=r"train-00001\.h5: token id 256 at token offset 77 is >= model\.vocab_size 256"
    ):
        for i in range(len(ds)):
            ds[i]
    ds = TokenWindows(paths, 16)  # without a model vocab: the shard's own vocab_size bounds ids
    _poison(paths[0], 5, 300)
    with pytest.raises(
        DataError, match=r"train-00000\.h5: token id 300 at token offset 5 is >= the shard's vocab_size 257"
    ):
        ds[0]


def test_bad_window_in_a_worker_is_one_line(tmp_path):
    paths, _ = _make_shards(tmp_path, [400])
    _poison(paths[0], 100, 300)
    ds = TokenWindows(paths, 16, model_vocab_size=257)
    loader = DataLoader(ds, batch_sampler=EpochBatchSampler(len(ds), 4, shuffle=False), num_workers=1)
    with pytest.raises(DataError) as e:
        list(loader)
    assert str(e.value) == (
        f"{paths[0]}: token id 300 at token offset 100 is >= model.vocab_size 257; the shard is "
        "corrupt or was made with another tokenizer: re-run `python -m steadylm.data.prepare`"
    )


def test_truncated_or_unreadable_data_mid_run_names_the_file(tmp_path):
    import dataclasses

    from steadylm.data.shards import read_shard_info

    paths, _ = _make_shards(tmp_path, [300])
    info = read_shard_info(paths[0])
    lying = dataclasses.replace(info, n_tokens=600)  # the file lost its tail after setup read the attrs
    ds = TokenWindows(paths, 16, infos=[lying])
    with pytest.raises(DataError, match=r"train-00000\.h5: window at token offset 288 has 12 of 17 tokens"):
        ds[18]
    ds.close()
    paths[0].write_bytes(b"garbage")
    ds2 = TokenWindows(paths, 16, infos=[info])
    with pytest.raises(DataError, match=r"train-00000\.h5: not a readable HDF5 file"):
        ds2[0]


def test_val_bytes_and_tokens(tmp_path):
    d = tmp_path / "v"
    _make_shards(d, [500])
    write_shard(d / "val-00000.h5", np.arange(100) % 250, n_bytes=140, **BYTES)
    write_shard(d / "val-00001.h5", np.arange(50) % 250, n_bytes=60, **BYTES)
    dm = ShardDataModule(d, context_length=16)
    assert dm.bytes_per_token == 200 / 150
    write_shard(d / "val-00002.h5", np.arange(30) % 250, **BYTES)  # format 1: no byte count
    dm = ShardDataModule(d, context_length=16)
    assert dm.bytes_per_token is None


def test_prepared_shards_give_val_bytes(tmp_path):
    from steadylm.data.prepare import prepare

    s = prepare(out_dir=tmp_path / "p", max_bytes=60_000, val_fraction=0.2, progress=False)
    dm = ShardDataModule(tmp_path / "p", context_length=32)
    assert dm.bytes_per_token == s["bytes"]["val"] / s["tokens"]["val"]


def test_bpe_shards_accepted_by_the_datamodule(tmp_path):
    from steadylm.data.prepare import prepare

    prepare(
        out_dir=tmp_path / "b",
        max_bytes=80_000,
        val_fraction=0.2,
        tokenizer="bpe",
        vocab_size=400,
        num_proc=1,
        progress=False,
    )
    dm = ShardDataModule(tmp_path / "b", context_length=32, tokenizer="bpe", model_vocab_size=448, batch_size=2)
    x, y = next(iter(dm.train_dataloader()))
    assert dm.vocab_size == 400 and dm.infos["train"][0].eos_id == 0 and int(x.max()) < 400
    with pytest.raises(DataError, match=r"vocab_size 400 exceeds model\.vocab_size 320"):
        ShardDataModule(tmp_path / "b", context_length=32, tokenizer="bpe", model_vocab_size=320).setup("fit")
