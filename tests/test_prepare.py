import gzip
import hashlib
import json

import h5py
import numpy as np
import pytest

from steadylm.data.prepare import bpe_vocab_size, main, prepare, prepare_kwargs, stdlib_files, val_slices
from steadylm.data.shards import read_shard_info
from steadylm.data.tokenizer import load_tokenizer
from steadylm.errors import ConfigError, DataError, SteadyError


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
    assert tok.name == "bytes" and tok.eos_id == 256
    assert json.loads((out / "tokenizer.json").read_text())["model"]["type"] == "BPE"  # a Hugging Face file
    train = sorted(out.glob("train-*.h5"))
    val = sorted(out.glob("val-*.h5"))
    assert len(train) > 1 and len(val) >= 1  # shard_tokens=100 forces several train shards
    assert [str(p) for p in train] == summary["shards"]["train"]
    for p in train + val:
        info = read_shard_info(p, deep=True)
        assert info.tokenizer == "bytes" and info.vocab_size == 257 and info.dtype == "uint16"
        assert info.n_tokens <= 100 and info.format_version == 2
    # Val: a quarter of the tokens, the stream's tail (one slice: under 2 x 2048 val tokens); train then val is the input.
    stream = b"".join(d.encode() + b"\xff" for d in docs)  # bytes ids, 0xff standing for eos (256)
    n_val = round(0.25 * len(stream))
    assert summary["tokens"] == {"train": len(stream) - n_val, "val": n_val}
    assert _docs_from_shards(train + val, tok) == docs
    # n_bytes: the UTF-8 bytes of the text behind each split's tokens
    tail = stream[-n_val:]
    assert sum(read_shard_info(p).n_bytes for p in val) == len(tail) - tail.count(b"\xff")
    assert summary["bytes"]["train"] + summary["bytes"]["val"] == sum(len(d.encode()) for d in docs)
    assert summary["documents"] == {"train": len(docs) - tail.count(b"\xff"), "val": tail.count(b"\xff")}
    assert summary["tokens"]["train"] == sum(p.n_tokens for p in map(read_shard_info, train))
    assert not [p for p in out.iterdir() if p.name.startswith(".") or p.suffix == ".partial"]


def test_prepare_glob_and_list(tmp_path, corpus):
    src, docs = corpus
    s1 = prepare(input=str(src / "d*.txt"), out_dir=tmp_path / "a", val_fraction=0.5, progress=False)
    assert s1["tokens"]["val"] == round(0.5 * sum(s1["tokens"].values()))
    s2 = prepare(input=[src / "d0.txt", src / "more.jsonl"], out_dir=tmp_path / "b", val_fraction=0.5, progress=False)
    assert s2["documents"]["train"] + s2["documents"]["val"] == 7


def test_a_folder_of_your_own_text_is_read_whatever_the_suffixes_less_hidden_files(tmp_path):
    src = tmp_path / "notes"
    (src / "code").mkdir(parents=True)
    (src / ".git").mkdir()
    texts = {"README.md": "# notes\n", "code/main.py": "print('hi')\n", "LICENSE": "MIT\n"}
    for name, text in texts.items():
        (src / name).write_text(text)
    (src / ".git" / "index").write_bytes(b"DIRC\x00\x00")  # binary, and hidden: never read
    (src / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    out = tmp_path / "out"
    prepare(input=src, out_dir=out, val_fraction=0.5, progress=False)
    shards = sorted(out.glob("train-*.h5")) + sorted(out.glob("val-*.h5"))
    assert _docs_from_shards(shards, load_tokenizer(out)) == [
        texts[k] for k in ("LICENSE", "README.md", "code/main.py")
    ]


def test_prepare_embedded_corpus_small(tmp_path, capsys):
    files = stdlib_files()
    assert files and not any(
        part in {"site-packages", "test", "tests", "idlelib", "lib2to3"} for f in files for part in f.parts[-3:-1]
    )
    out = tmp_path / "std"
    s = prepare(out_dir=out, max_bytes=300_000, val_fraction=0.1, progress=False)
    assert s["documents"]["val"] >= 1 and s["tokens"]["train"] > 0
    total = s["tokens"]["train"] + s["tokens"]["val"] - sum(s["documents"].values())  # minus eos
    assert total == 300_000
    assert "prepared" in capsys.readouterr().out
    tok = load_tokenizer(out)
    ids = np.concatenate([h5py.File(p, "r")["tokens"][:] for p in s["shards"]["train"] + s["shards"]["val"]])
    assert tok.decode(ids[: ids.tolist().index(tok.eos_id)]) == files[0].read_text(encoding="utf-8", errors="replace")
    assert s["tokens"]["val"] == round(0.1 * (s["tokens"]["train"] + s["tokens"]["val"]))


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
        (lambda d: (d / "x.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00") and d / "x.png", r"x\.png: looks binary"),
        (
            lambda d: (d / "bad.jsonl").write_text('{"txt": 1}\n') and d / "bad.jsonl",
            r"bad\.jsonl:1: no string field 'text'",
        ),
        (lambda d: (d / "latin.txt").write_bytes(b"caf\xe9") and d / "latin.txt", r"latin\.txt: is not UTF-8"),
        (
            lambda d: (
                (d / "empty" / ".git").mkdir(parents=True)
                or (d / "empty" / ".git" / "HEAD").write_text("x")
                and d / "empty"
            ),
            r"empty: data\.input folder holds no files",
        ),
        (lambda d: (d / "zero.txt").write_bytes(b"") or d / "zero.txt", r"zero\.txt: input file is empty"),
        (lambda d: (d / "zero.jsonl").write_bytes(b"") or d / "zero.jsonl", r"zero\.jsonl: input file is empty"),
        (
            lambda d: (d / "bin.txt").write_bytes(b"ELF\x00\x01\x02") and d / "bin.txt",
            r"bin\.txt: looks binary \(NUL byte at byte 3\)",
        ),
        (
            lambda d: (d / "c.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n' * 500)[:60]) and d / "c.jsonl.gz",
            r"c\.jsonl\.gz: corrupt compressed stream",
        ),
        (
            lambda d: (d / "c.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd garbage") and d / "c.jsonl.zst",
            r"c\.jsonl\.zst: corrupt compressed stream",
        ),
        (
            lambda d: (d / "p.parquet").write_bytes(b"PAR1 not really") and d / "p.parquet",
            r"p\.parquet: not a readable parquet file",
        ),
    ],
)
def test_bad_input(tmp_path, make, pattern):
    with pytest.raises(DataError, match=pattern) as e:
        prepare(input=make(tmp_path), out_dir=tmp_path / "out", progress=False)
    assert "\n" not in str(e.value)
    assert not [p for p in (tmp_path / "out").glob("*")] if (tmp_path / "out").exists() else True


def test_too_few_documents(tmp_path):
    (tmp_path / "one.txt").write_text("only one")
    with pytest.raises(
        DataError, match=r"9 token\(s\), too few for a train and a val split at data\.val_fraction=0\.01"
    ):
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


def test_prepare_kwargs_come_from_the_composed_config():
    from steadylm.cli import compose_command

    cfg = compose_command(
        "prepare",
        [
            "data.dir=/x",
            "data.input=[a.txt,b.jsonl]",
            "data.val_fraction=0.1",
            "data.shard_tokens=5",
            "data.max_bytes=null",
            "data.batch_size=4",
            "data.text_field=body",
            "data.vocab_size=4096",
            "data.num_proc=3",
            "data.on_bad_record=skip",
            "data.tokenizer=bpe",
            "data.bpe_sample_bytes=1000",
        ],
    )
    assert prepare_kwargs(cfg) == {
        "out_dir": "/x",
        "input": ["a.txt", "b.jsonl"],
        "val_fraction": 0.1,
        "shard_tokens": 5,
        "text_field": "body",
        "vocab_size": 4096,
        "num_proc": 3,
        "on_bad_record": "skip",
        "tokenizer": "bpe",
        "bpe_sample_bytes": 1000,
    }
    with pytest.raises(SteadyError, match="model.x is not a config key"):
        compose_command("prepare", ["model.x=1"])
    with pytest.raises(SteadyError, match="data.shard_tokens='many' is not allowed; it must be a whole number"):
        compose_command("prepare", ["data.shard_tokens=many"])


def run_main(argv) -> int:
    try:
        main(argv)
    except SystemExit as e:
        return int(e.code)
    return 0


def test_cli(tmp_path, corpus, capsys):
    src, _ = corpus
    out = tmp_path / "cli"
    assert run_main([f"data.dir={out}", f"data.input={src}", "data.val_fraction=0.25", "data.max_bytes=10000"]) == 0
    assert (out / "train-00000.h5").exists() and (out / "val-00000.h5").exists()
    assert run_main([f"data.dir={out}", f"data.input={tmp_path / 'nope.txt'}"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "nope.txt" in err and "Traceback" not in err


# --- inputs at scale: formats, fields, bad records ---------------------------------------------------------


def _texts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [f"doc {i}: " + " ".join(f"w{int(x)}" for x in rng.integers(0, 50, 1 + i % 13)) + " é🐍\n" for i in range(n)]


def _all_docs(out):
    """Every document in input order: with one val slice (small inputs) val is the token stream's tail."""
    tok = load_tokenizer(out)
    return _docs_from_shards(sorted(out.glob("train-*.h5")) + sorted(out.glob("val-*.h5")), tok)


@pytest.fixture
def mixed(tmp_path):
    """The same 600 documents spread over every input format, in sorted-name order."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    docs = _texts(600)
    d = tmp_path / "mixed"
    d.mkdir()
    line = lambda t: json.dumps({"body": t, "n": 1})  # noqa: E731
    (d / "a.jsonl").write_text("\n".join(map(line, docs[:150])) + "\n")
    with gzip.open(d / "b.jsonl.gz", "wt") as f:
        f.write("\n".join(map(line, docs[150:250])) + "\n")
    (d / "c.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(("\n".join(map(line, docs[250:350])) + "\n").encode())
    )
    pq.write_table(pa.table({"body": docs[350:590], "n": list(range(240))}), d / "d.parquet", row_group_size=50)
    for i, t in enumerate(docs[590:]):
        (d / f"e{i}.txt").write_text(t)
    return d, docs


def test_every_format_in_one_input_with_text_field(tmp_path, mixed):
    d, docs = mixed
    s = prepare(input=d, out_dir=tmp_path / "out", text_field="body", val_fraction=0.1, num_proc=1, progress=False)
    assert _all_docs(tmp_path / "out") == docs
    assert sum(s["bytes"].values()) == sum(len(t.encode()) for t in docs)
    with pytest.raises(DataError, match=r"a\.jsonl:1: no string field 'text' \(data\.text_field\)"):
        prepare(input=d, out_dir=tmp_path / "o2", progress=False)
    with pytest.raises(DataError, match=r"d\.parquet: no column 'text' \(data\.text_field\); columns are body, n"):
        prepare(input=d / "d.parquet", out_dir=tmp_path / "o2", progress=False)


def test_datasets_save_to_disk_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    docs = _texts(40)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": docs[:20]}),
            "test": datasets.Dataset.from_dict({"text": docs[20:]}),
        }
    ).save_to_disk(str(tmp_path / "dd"))
    prepare(input=tmp_path / "ds", out_dir=tmp_path / "o1", val_fraction=0.25, progress=False)
    assert _all_docs(tmp_path / "o1") == docs
    prepare(input=tmp_path / "dd", out_dir=tmp_path / "o2", val_fraction=0.25, progress=False)  # its train split
    assert _all_docs(tmp_path / "o2") == docs[:20]


def dataset_with_configs(folder, docs: dict) -> str:
    """A local `datasets` folder whose README names configs and splits, as hub datasets do: no network."""
    card = ["---", "configs:"]
    for config, splits in docs.items():
        card += [f"- config_name: {config}", "  data_files:"]
        for split, texts in splits.items():
            path = folder / config / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
            card += [f"  - split: {split}", f"    path: {config}/{split}.jsonl"]
    (folder / "README.md").write_text("\n".join([*card, "---", ""]))
    return str(folder)


def test_hf_input_names_a_config_and_a_split(tmp_path, capsys):
    pytest.importorskip("datasets")
    docs = {"en": {"train": _texts(30), "validation": _texts(20, seed=1)}, "de": {"train": _texts(25, seed=2)}}
    ds = dataset_with_configs(tmp_path / "ds", docs)
    prepare(input=f"hf:{ds}:en@validation", out_dir=tmp_path / "o1", val_fraction=0.25, progress=False)
    assert _all_docs(tmp_path / "o1") == docs["en"]["validation"]
    prepare(input=f"hf:{ds}:de", out_dir=tmp_path / "o2", val_fraction=0.25, progress=False)  # split train
    assert _all_docs(tmp_path / "o2") == docs["de"]["train"]
    for spec, message in [
        (f"{ds}:fr", "no config 'fr'"),
        (f"{ds}:de@validation", "no split 'validation'"),
        (f"{tmp_path / 'nowhere'}", "no such dataset"),
    ]:
        capsys.readouterr()
        assert run_main([f"data.dir={tmp_path / 'o3'}", f"data.input=hf:{spec}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    with pytest.raises(DataError, match=r"hf:.*:en: row 0 has no string field 'body' \(data\.text_field\)"):
        prepare(input=f"hf:{ds}:en", out_dir=tmp_path / "o4", text_field="body", progress=False)


def test_on_bad_record_skip_counts(tmp_path, capsys):
    d = tmp_path / "in"
    d.mkdir()
    good = _texts(20)
    lines = [json.dumps({"text": t}) for t in good]
    lines[3] = "not json"
    lines[7] = json.dumps({"other": 1})
    (d / "a.jsonl").write_text("\n".join(lines) + "\n")
    (d / "b.txt").write_bytes(b"\x00\x01binary")
    with pytest.raises(DataError, match=r"a\.jsonl:4: invalid JSON.*set data\.on_bad_record=skip"):
        prepare(input=d, out_dir=tmp_path / "out", progress=False)
    s = prepare(input=d, out_dir=tmp_path / "out", on_bad_record="skip", val_fraction=0.2, progress=False)
    assert s["skipped_records"] == 3 and "a.jsonl:4: invalid JSON" in s["first_skipped"]
    assert "skipped 3 bad record(s)" in capsys.readouterr().out
    assert _all_docs(tmp_path / "out") == [t for i, t in enumerate(good) if i not in (3, 7)]


def test_jsonl_cut_into_byte_ranges_reads_every_line_once(tmp_path, monkeypatch):
    import steadylm.data.readers as readers

    docs = _texts(500)
    (tmp_path / "big.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in docs) + "\n")
    prepare(input=tmp_path / "big.jsonl", out_dir=tmp_path / "whole", val_fraction=0.1, num_proc=1, progress=False)
    monkeypatch.setattr(readers, "UNIT_BYTES", 997)  # many ranges, cut mid-line
    s = prepare(input=tmp_path / "big.jsonl", out_dir=tmp_path / "cut", val_fraction=0.1, num_proc=1, progress=False)
    assert s["units"] > 20
    assert _digest(tmp_path / "cut") == _digest(tmp_path / "whole")
    # a bad line in a later range is still named by its line number
    lines = (tmp_path / "big.jsonl").read_text().splitlines()
    lines[401] = "{broken"
    (tmp_path / "big.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"big\.jsonl:402: invalid JSON"):
        prepare(input=tmp_path / "big.jsonl", out_dir=tmp_path / "cut", num_proc=1, progress=False)


def test_large_txt_is_read_in_pieces_with_the_same_ids(tmp_path, monkeypatch):
    import steadylm.data.readers as readers

    text = "".join(_texts(300)) + "no newline at the end: ünïcödé 🐍" * 20
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.txt").write_text("second document\n")
    monkeypatch.setattr(readers, "PIECE_BYTES", 100)
    prepare(input=tmp_path, out_dir=tmp_path / "out", val_fraction=0.1, progress=False)
    assert _all_docs(tmp_path / "out") == [text, "second document\n"]


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_shards_are_byte_identical_for_every_num_proc(tmp_path, mixed, monkeypatch, tokenizer):
    import steadylm.data.readers as readers

    d, _ = mixed
    monkeypatch.setattr(readers, "UNIT_BYTES", 4000)  # ~10 units, so the pool really runs
    runs = {}
    for n in (1, 2, 3):
        s = prepare(
            input=d,
            out_dir=tmp_path / f"p{n}",
            text_field="body",
            tokenizer=tokenizer,
            vocab_size=300,
            shard_tokens=5000,
            num_proc=n,
            progress=False,
        )
        assert s["num_proc"] == n and s["units"] >= 8
        runs[n] = _digest(tmp_path / f"p{n}")
    assert runs[1] == runs[2] == runs[3]
    assert len(runs[1]) > 3


def test_interrupted_prepare_leaves_nothing_and_resumes(tmp_path, mixed, monkeypatch):
    import steadylm.data.prepare as prep
    import steadylm.data.readers as readers

    d, _ = mixed
    monkeypatch.setattr(readers, "UNIT_BYTES", 4000)
    prepare(input=d, out_dir=tmp_path / "fresh", text_field="body", num_proc=1, progress=False)
    out = tmp_path / "out"
    real, calls = prep.encode_unit, []

    def dies_at_third(job):
        calls.append(job["k"])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(job)

    monkeypatch.setattr(prep, "encode_unit", dies_at_third)
    with pytest.raises(KeyboardInterrupt):
        prepare(input=d, out_dir=out, text_field="body", num_proc=1, progress=False)
    assert not list(out.glob("*.h5")) and not (out / "tokenizer.json").exists()  # nothing training would accept
    monkeypatch.setattr(prep, "encode_unit", real)
    s = prepare(input=d, out_dir=out, text_field="body", num_proc=1, progress=False)
    assert s["resumed_units"] == 2
    assert _digest(out) == _digest(tmp_path / "fresh")
    # a different command starts clean: the staging folder of the old one is removed
    monkeypatch.setattr(prep, "encode_unit", dies_at_third)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        prepare(
            input=d,
            out_dir=out,
            text_field="body",
            val_fraction=0.2,
            tokenizer="bpe",
            vocab_size=300,
            num_proc=1,
            progress=False,
        )
    monkeypatch.setattr(prep, "encode_unit", real)
    s = prepare(input=d, out_dir=out, text_field="body", num_proc=1, progress=False, shard_tokens=777)
    assert s["resumed_units"] == 0  # the bpe run's staging folder was not reused
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


def test_bpe_end_to_end_and_tokenizer_json_reuse(tmp_path, mixed):
    d, docs = mixed
    s = prepare(
        input=d,
        out_dir=tmp_path / "bpe",
        text_field="body",
        tokenizer="bpe",
        vocab_size=320,
        val_fraction=0.1,
        num_proc=1,
        progress=False,
    )
    tok = load_tokenizer(tmp_path / "bpe")
    assert (s["vocab_size"], tok.vocab_size, tok.eos_id) == (320, 320, 0)
    info = read_shard_info(tmp_path / "bpe" / "val-00000.h5")
    assert info.tokenizer == "bpe" and info.vocab_size == 320
    assert _all_docs(tmp_path / "bpe") == docs
    assert sum(s["bytes"].values()) == sum(len(t.encode()) for t in docs)  # exact for a byte-level BPE
    assert sum(s["tokens"].values()) < 0.6 * sum(len(t.encode()) for t in docs)
    # the saved tokenizer.json as data.tokenizer: the same ids
    spec = str(tmp_path / "bpe" / "tokenizer.json")
    s2 = prepare(
        input=d,
        out_dir=tmp_path / "again",
        text_field="body",
        tokenizer=spec,
        val_fraction=0.1,
        num_proc=1,
        progress=False,
    )
    assert s2["tokens"] == s["tokens"]
    assert read_shard_info(tmp_path / "again" / "val-00000.h5").tokenizer == spec


def test_bad_on_bad_record_value():
    with pytest.raises(ConfigError, match="data.on_bad_record='maybe' must be error or skip"):
        prepare(input="x", out_dir="y", on_bad_record="maybe")


def test_cli_composes_the_config_and_exits_2_on_bad_input(tmp_path, corpus, capsys):
    src, _ = corpus
    out = tmp_path / "cli"
    assert (
        run_main(
            [
                f"data.dir={out}",
                f"data.input={src}",
                "data.val_fraction=0.25",
                "data.num_proc=1",
                "data.tokenizer=bpe",
                "data.vocab_size=300",
            ]
        )
        == 0
    )
    assert 257 < read_shard_info(out / "train-00000.h5").vocab_size <= 300  # a tiny corpus runs out of merges
    (src / "bin.txt").write_bytes(b"\x00\x00")
    capsys.readouterr()
    assert run_main([f"data.dir={out}", f"data.input={src}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "bin.txt: looks binary" in err[0]


def test_demo_experiment_pairs_the_bpe_with_a_model_that_fits_it():
    from steadylm.cli import compose_command
    from steadylm.config import compose

    cfg = compose(["experiment=demo"])
    assert cfg.data.tokenizer == "bpe" and cfg.model.vocab_size is None  # training takes the shards' (2048)
    assert (cfg.optim.name, cfg.optim.lr) == ("muon", 1e-2)  # Muon wins at this size (docs/data.md)
    assert cfg.data.vocab_size % 64 == 0 and cfg.data.dir.endswith("stdlib-bpe")
    kw = prepare_kwargs(compose_command("prepare", ["experiment=demo"]))  # `make demo` prepares with the same config
    assert (kw["tokenizer"], kw["vocab_size"], kw["out_dir"]) == ("bpe", cfg.data.vocab_size, cfg.data.dir)


@pytest.mark.parametrize("n,fraction", [(10, 0.1), (1000, 0.01), (12_345, 0.3), (10**7, 0.01), (999_983, 0.001)])
def test_val_slices_hold_the_fraction_exactly_spread_through_the_stream(n, fraction):
    slices = val_slices(n, fraction)
    assert sum(b - a for a, b in slices) == round(fraction * n)  # exact: no tolerance needed
    assert all(0 <= a <= b <= c for (a, b), (c, _) in zip(slices, [*slices[1:], (n, n)]))  # sorted, disjoint
    assert len(slices) == max(1, min(100, round(fraction * n) // 2048)) and slices[-1][1] == n
    assert val_slices(n, fraction) == slices  # deterministic


def test_val_gets_the_fraction_of_tokens_when_the_first_document_dominates(tmp_path):
    """Document 0 holds 90 % of the text: val still gets 1 % of the tokens, from every part of the input."""
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.txt").write_text("big " * 90_000)
    for i in range(10):
        (src / f"b{i}.txt").write_text(f"small {i} " * 4_000)
    s = prepare(input=src, out_dir=tmp_path / "out", progress=False)
    assert s["tokens"]["val"] == round(0.01 * sum(s["tokens"].values())) == 6800 and s["val_slices"] == 3
    text = load_tokenizer(tmp_path / "out").decode(h5py.File(s["shards"]["val"][0], "r")["tokens"][:])
    assert "big " in text and "small 9 " in text  # from the big first file and from the last one


def test_the_default_bpe_vocabulary_follows_the_text():
    sizes = (1_000, 300_000, 12_000_000, 64 << 20, 10**9, 10**12)
    assert [bpe_vocab_size(n) for n in sizes] == [512, 512, 4096, 8192, 32768, 32768]
