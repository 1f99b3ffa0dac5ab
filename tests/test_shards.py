import re
import warnings

import h5py
import numpy as np
import pytest

from steadylm.data.prepare import write_shard
from steadylm.data.shards import open_tokens, read_shard_info
from steadylm.errors import DataError
from tests.helpers import raw_shard

BYTES = dict(vocab_size=257, eos_id=256, tokenizer="bytes")


def _tokens(n=1000, vocab=257, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, n)


@pytest.mark.parametrize("vocab,dtype", [(257, "uint16"), (65536, "uint16"), (70000, "uint32")])
def test_round_trip_dtype_and_attrs(tmp_path, vocab, dtype):
    toks = _tokens(200_000, vocab)
    toks[5] = vocab - 1
    p = tmp_path / "train-00000.h5"
    info = write_shard(p, toks, vocab_size=vocab, eos_id=vocab - 1, tokenizer="t")
    assert not p.with_suffix(".h5.partial").exists()
    with h5py.File(p, "r") as f:
        ds = f["tokens"]
        assert ds.dtype == np.dtype(dtype) and ds.shape == (200_000,)
        assert ds.chunks == (65536,) and ds.compression is None
        np.testing.assert_array_equal(ds[:], toks)
        assert dict(f.attrs) == {
            "format_version": 1,
            "vocab_size": vocab,
            "eos_id": vocab - 1,
            "tokenizer": "t",
            "n_tokens": 200_000,
            "max_token_id": vocab - 1,
        }
    read = read_shard_info(p, deep=True)
    assert read == info
    assert (read.n_tokens, read.max_token_id, read.dtype, read.tokenizer) == (200_000, vocab - 1, dtype, "t")
    assert (read.format_version, read.n_bytes) == (1, None)


def test_format_2_carries_n_bytes_and_writes_format_attrs_last(tmp_path, monkeypatch):
    order = []
    original = h5py.AttributeManager.__setitem__

    def recording(self, name, value):
        order.append(name)
        original(self, name, value)

    monkeypatch.setattr(h5py.AttributeManager, "__setitem__", recording)
    p = tmp_path / "val-00000.h5"
    info = write_shard(p, np.arange(100) % 257, n_bytes=123, **BYTES)
    monkeypatch.undo()
    assert (info.format_version, info.n_bytes) == (2, 123)
    # a reader that sees format_version knows every other attribute (and the data) was written before it
    assert order[-3:] == ["max_token_id", "n_bytes", "format_version"]
    with h5py.File(p, "r") as f:
        assert dict(f.attrs)["n_bytes"] == 123 and f.attrs["format_version"] == 2
    assert read_shard_info(p) == info


def test_format_2_without_n_bytes_is_refused(tmp_path):
    p = tmp_path / "nob.h5"
    raw_shard(p, np.arange(10, dtype=np.uint16), {"format_version": 2})
    _expect(p, "missing attribute 'n_bytes'")


def test_small_shard_chunk_fits(tmp_path):
    p = tmp_path / "s.h5"
    write_shard(p, np.array([1, 2, 3]), **BYTES)
    np.testing.assert_array_equal(open_tokens(p)[:], [1, 2, 3])


def test_open_tokens_random_reads(tmp_path):
    toks = _tokens(300_000)
    p = tmp_path / "s.h5"
    write_shard(p, toks, **BYTES)
    ds = open_tokens(p)
    for start in np.random.default_rng(1).integers(0, 299_000, 50):
        np.testing.assert_array_equal(ds[start : start + 257], toks[start : start + 257])
    ds.file.close()


def test_write_refuses_oov_and_leaves_nothing(tmp_path):
    p = tmp_path / "s.h5"
    with pytest.raises(DataError, match="s.h5.*vocab_size is 257"):
        write_shard(p, np.array([1, 300]), **BYTES)
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_disk_full_leaves_no_file_and_keeps_existing(tmp_path, monkeypatch):
    p = tmp_path / "train-00000.h5"
    write_shard(p, np.arange(10), **BYTES)
    before = p.read_bytes()
    other = tmp_path / "keep.txt"
    other.write_text("precious")

    def disk_full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(h5py.Dataset, "__setitem__", disk_full)
    with pytest.raises(DataError, match=r"train-00000\.h5.*No space left on device"):
        write_shard(p, np.arange(100), **BYTES)
    new = tmp_path / "train-00001.h5"
    with pytest.raises(DataError, match=r"train-00001\.h5"):
        write_shard(new, np.arange(100), **BYTES)
    monkeypatch.undo()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["keep.txt", "train-00000.h5"]
    assert p.read_bytes() == before and other.read_text() == "precious"
    assert read_shard_info(p).n_tokens == 10


def test_atomic_write_conversion_error(tmp_path):
    class Bad:
        def __array__(self, *a, **k):
            raise ValueError("boom")

    with pytest.raises(DataError, match="s.h5.*boom"):
        write_shard(tmp_path / "s.h5", Bad(), **BYTES)
    assert list(tmp_path.iterdir()) == []


# --- bad shards: each one error naming the file and the problem -----------------------------


def _expect(path, pattern, **kw):
    with pytest.raises(DataError) as e:
        read_shard_info(path, **kw)
    msg = str(e.value)
    assert path.name in msg, msg
    assert re.search(pattern, msg), msg
    return msg


def test_missing_file(tmp_path):
    _expect(tmp_path / "nope.h5", "not found")


def test_not_hdf5(tmp_path):
    p = tmp_path / "text.h5"
    p.write_text("hello, I am not HDF5")
    _expect(p, "not a readable HDF5 file")


def test_truncated(tmp_path):
    p = tmp_path / "trunc.h5"
    write_shard(p, _tokens(200_000), **BYTES)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    _expect(p, "truncated or corrupt")


def test_float_tokens(tmp_path):
    p = tmp_path / "float.h5"
    raw_shard(p, np.arange(10, dtype=np.float32))
    _expect(p, "dtype float32.*unsigned integers")


def test_signed_tokens(tmp_path):
    p = tmp_path / "signed.h5"
    raw_shard(p, np.arange(10, dtype=np.int64))
    _expect(p, "dtype int64")


def test_missing_dataset(tmp_path):
    p = tmp_path / "nodata.h5"
    raw_shard(p, None)
    _expect(p, "no 'tokens' dataset")


def test_not_1d(tmp_path):
    p = tmp_path / "2d.h5"
    raw_shard(p, np.zeros((4, 4), dtype=np.uint16))
    _expect(p, "must be 1-D")


def test_wrong_format_version(tmp_path):
    p = tmp_path / "v3.h5"
    raw_shard(p, np.arange(10, dtype=np.uint16), {"format_version": 3})
    _expect(p, "format_version 3 is not supported.*versions 1, 2")


def test_missing_attr(tmp_path):
    p = tmp_path / "noattr.h5"
    raw_shard(p, np.arange(10, dtype=np.uint16), {"max_token_id": None})
    _expect(p, "missing attribute 'max_token_id'")


def test_oov_ids_attr(tmp_path):
    p = tmp_path / "oov.h5"
    raw_shard(p, np.array([1, 2, 300], dtype=np.uint16))
    _expect(p, "max_token_id 300 >= vocab_size 257")


def test_oov_ids_deep_scan_catches_lying_attr(tmp_path):
    p = tmp_path / "liar.h5"
    raw_shard(p, np.array([1, 2, 300], dtype=np.uint16), {"max_token_id": 2})
    assert read_shard_info(p).max_token_id == 2  # shallow check trusts the attribute
    _expect(p, "token id 300 at token offset 2 is >= vocab_size 257", deep=True)


def test_scan_names_the_first_bad_offset_across_blocks(tmp_path, monkeypatch):
    import steadylm.data.shards as shards

    monkeypatch.setattr(shards, "_SCAN_BLOCK", 64)
    toks = np.arange(1000, dtype=np.uint16) % 200
    toks[700], toks[900] = 280, 290
    p = tmp_path / "deep.h5"
    raw_shard(p, toks, {"max_token_id": 199})
    _expect(p, "token id 280 at token offset 700 is >= vocab_size 257", deep=True, progress=True)
    with h5py.File(p, "r") as f:
        with pytest.raises(DataError, match="deep.h5: token id 280 at token offset 700 is >= vocab_size 256"):
            shards.scan_tokens(f["tokens"], p, 256)


def test_open_tokens_refuses_wrong_dtype(tmp_path):
    p = tmp_path / "f.h5"
    raw_shard(p, np.arange(10, dtype=np.float32))
    with pytest.raises(DataError, match="f.h5: 'tokens' is not a 1-D unsigned-integer dataset"):
        open_tokens(p)


def test_empty(tmp_path):
    p = tmp_path / "empty.h5"
    raw_shard(p, np.zeros(0, dtype=np.uint16))
    _expect(p, "empty")


def test_n_tokens_mismatch(tmp_path):
    p = tmp_path / "short.h5"
    raw_shard(p, np.arange(10, dtype=np.uint16), {"n_tokens": 20})
    _expect(p, "n_tokens=20.*10 tokens")


def test_compressed_warns_not_fails(tmp_path):
    p = tmp_path / "gz.h5"
    raw_shard(p, np.arange(100, dtype=np.uint16), compression="gzip", chunks=(50,))
    with pytest.warns(UserWarning, match="gz.h5.*compressed.*slow"):
        info = read_shard_info(p)
    assert info.n_tokens == 100
    write_shard(tmp_path / "ok.h5", np.arange(5), **BYTES)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_shard_info(tmp_path / "ok.h5")  # prepare's own shards never warn
