import json

import h5py
import numpy as np
import pytest

from steadylm.data.prepare import main, parse_overrides, prepare, stdlib_files
from steadylm.data.shards import read_shard_info
from steadylm.data.tokenizer import load_tokenizer
from steadylm.errors import ConfigError, DataError


def _docs_from_shards(paths, tok):
    ids = np.concatenate([h5py.File(p, "r")["tokens"][:] for p in paths]).tolist()
    docs, cur = [], []
    for i in ids:
        if i == tok.eos_id:
            docs.append(tok.decode(cur))
            cur = []
        else:
            cur.append(i)
    assert cur == []  # every document ends with eos
    return docs


@pytest.fixture
def corpus(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    texts = [f"document {i}: héllo wörld ✓\n" * (i + 1) for i in range(5)]
    for i, t in enumerate(texts):
        (src / f"d{i}.txt").write_text(t, encoding="utf-8")
    lines = [f"json doc {i} 🐍" for i in range(6)]
    (src / "more.jsonl").write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(lines)) + "\n\n")
    return src, texts + lines  # sorted order: d0..d4.txt, then more.jsonl


def test_prepare_txt_and_jsonl(tmp_path, corpus):
    src, docs = corpus
    out = tmp_path / "out"
    summary = prepare(input=src, out_dir=out, val_fraction=0.25, shard_tokens=100, progress=False)
    tok = load_tokenizer(out)
    assert tok.name == "bytes"
    assert json.loads((out / "tokenizer.json").read_text())["eos_id"] == 256
    train = sorted(out.glob("train-*.h5"))
    val = sorted(out.glob("val-*.h5"))
    assert len(train) > 1 and len(val) >= 1  # shard_tokens=100 forces several train shards
    assert [str(p) for p in train] == summary["shards"]["train"]
    for p in train + val:
        info = read_shard_info(p, deep=True)
        assert info.tokenizer == "bytes" and info.vocab_size == 257 and info.dtype == "uint16"
        assert info.n_tokens <= 100
    # Document i goes to val when i % round(1/0.25) == 0.
    assert _docs_from_shards(val, tok) == [d for i, d in enumerate(docs) if i % 4 == 0]
    assert _docs_from_shards(train, tok) == [d for i, d in enumerate(docs) if i % 4 != 0]
    assert summary["documents"] == {"train": 8, "val": 3}
    assert summary["tokens"]["train"] == sum(p.n_tokens for p in map(read_shard_info, train))
    assert not [p for p in out.iterdir() if p.name.startswith(".") or p.suffix == ".partial"]


def test_prepare_glob_and_list(tmp_path, corpus):
    src, docs = corpus
    s1 = prepare(input=str(src / "d*.txt"), out_dir=tmp_path / "a", val_fraction=0.5, progress=False)
    assert s1["documents"] == {"train": 2, "val": 3}
    s2 = prepare(input=[src / "d0.txt", src / "more.jsonl"], out_dir=tmp_path / "b", val_fraction=0.5, progress=False)
    assert s2["documents"]["train"] + s2["documents"]["val"] == 7


def test_prepare_embedded_corpus_small(tmp_path, capsys):
    files = stdlib_files()
    assert files and not any(part in {"site-packages", "test", "tests", "idlelib", "lib2to3"} for f in files for part in f.parts[-3:-1])
    out = tmp_path / "std"
    s = prepare(out_dir=out, max_bytes=300_000, val_fraction=0.1, progress=False)
    assert s["documents"]["val"] >= 1 and s["tokens"]["train"] > 0
    total = s["tokens"]["train"] + s["tokens"]["val"] - sum(s["documents"].values())  # minus eos
    assert total == 300_000
    assert "prepared" in capsys.readouterr().out
    tok = load_tokenizer(out)
    val_text = _docs_from_shards(s["shards"]["val"], tok)[0]
    assert val_text == files[0].read_text(encoding="utf-8", errors="replace")[: len(val_text)]


def test_rerun_replaces_old_shards(tmp_path, corpus):
    src, _ = corpus
    out = tmp_path / "out"
    prepare(input=src, out_dir=out, val_fraction=0.25, shard_tokens=50, progress=False)
    assert len(list(out.glob("train-*.h5"))) > 3
    prepare(input=src, out_dir=out, val_fraction=0.25, shard_tokens=10_000, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "train-00000.h5", "val-00000.h5"]


def test_failed_prepare_leaves_out_dir_untouched(tmp_path, corpus):
    src, _ = corpus
    out = tmp_path / "out"
    prepare(input=src, out_dir=out, val_fraction=0.25, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (src / "z.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match=r"z\.jsonl:2: invalid JSON"):
        prepare(input=src, out_dir=out, val_fraction=0.25, shard_tokens=20, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize(
    "make,pattern",
    [
        (lambda d: d / "missing.txt", r"missing\.txt: data\.input file not found"),
        (lambda d: str(d / "*.nothing"), r"\*\.nothing: data\.input pattern matches no files"),
        (lambda d: (d / "x.csv").write_text("a") and d / "x.csv", r"x\.csv: unsupported input type"),
        (lambda d: (d / "bad.jsonl").write_text('{"txt": 1}\n') and d / "bad.jsonl", r"bad\.jsonl:1: no string field 'text'"),
        (lambda d: (d / "latin.txt").write_bytes(b"caf\xe9") and d / "latin.txt", r"latin\.txt: is not UTF-8"),
        (lambda d: (d / "empty").mkdir() or d / "empty", r"empty: data\.input folder holds no"),
    ],
)
def test_bad_input(tmp_path, make, pattern):
    with pytest.raises(DataError, match=pattern):
        prepare(input=make(tmp_path), out_dir=tmp_path / "out", progress=False)


def test_too_few_documents(tmp_path):
    (tmp_path / "one.txt").write_text("only one")
    with pytest.raises(DataError, match="1 document.*too few"):
        prepare(input=tmp_path / "one.txt", out_dir=tmp_path / "out", progress=False)
    assert not list((tmp_path / "out").iterdir())


def test_out_dir_not_writable(tmp_path, corpus):
    src, _ = corpus
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DataError, match=r"file/sub: output folder is not writable"):
        prepare(input=src, out_dir=blocker / "sub", progress=False)


def test_bad_val_fraction(tmp_path, corpus):
    with pytest.raises(ConfigError, match="data.val_fraction"):
        prepare(input=corpus[0], out_dir=tmp_path / "o", val_fraction=0.9, progress=False)


def test_parse_overrides():
    kw = parse_overrides(["data.dir=/x", "data.input=[a.txt, b.jsonl]", "data.val_fraction=0.1",
                          "data.shard_tokens=5", "data.max_bytes=null", "data.batch_size=4"])
    assert kw == {"out_dir": "/x", "input": ["a.txt", "b.jsonl"], "val_fraction": 0.1, "shard_tokens": 5, "max_bytes": None}
    with pytest.raises(ConfigError, match="model.x"):
        parse_overrides(["model.x=1"])


def test_cli(tmp_path, corpus, capsys):
    src, _ = corpus
    out = tmp_path / "cli"
    assert main([f"data.dir={out}", f"data.input={src}", "data.val_fraction=0.25", "data.max_bytes=10000"]) == 0
    assert (out / "train-00000.h5").exists() and (out / "val-00000.h5").exists()
    assert main([f"data.dir={out}", f"data.input={tmp_path / 'nope.txt'}"]) == 1
    err = capsys.readouterr().err
    assert "error:" in err and "nope.txt" in err and "Traceback" not in err
