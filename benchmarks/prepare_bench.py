"""`prepare` throughput, scaling and memory, side by side in one run (`make bench` runs it).

Rows:
- bytes tokenizer: text MB/s of `prepare` with 1 process and with all cores on a generated `.jsonl`
  (> 1.5 GB by default, so the peak-RSS column shows memory does not grow with the input);
- BPE: `prepare` with a trained byte-level BPE `tokenizer.json` beside Hugging Face `tokenizers`' own
  `encode_batch` on the same documents with the same number of threads (RAYON_NUM_THREADS), 1 and all cores;
- the per-window vocabulary check the training reader runs on every window, against the read itself.

Each `prepare` runs in a fresh subprocess; its peak RSS is sampled every 50 ms over the whole process
tree (the sum over processes counts pages shared by forked workers once per process: an upper bound).
The input is generated from this interpreter's standard library sources (no download) in a temporary
folder that is removed at the end.

    python benchmarks/prepare_bench.py            # ~1.6 GB input, a few minutes on 2 cores
    python benchmarks/prepare_bench.py --quick    # ~40 MB, well under a minute
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
GOALS = {"bytes_mb_s_per_process": 50.0, "bpe_vs_tokenizers": 0.8, "peak_rss_gb": 1.0}


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def make_input(path: Path, megabytes: float) -> int:
    """A `.jsonl` of stdlib sources repeated to `megabytes`; returns the UTF-8 bytes of its texts."""
    sys.path.insert(0, str(ROOT / "src"))
    from steadylm.data.prepare import stdlib_files

    docs = [f.read_text(encoding="utf-8", errors="replace") for f in stdlib_files()]
    lines = [json.dumps({"text": d}) + "\n" for d in docs if d]
    sizes = [len(d.encode()) for d in docs if d]
    written = text = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < megabytes * 1e6:
            for line, size in zip(lines, sizes):
                f.write(line)
                written += len(line)
                text += size
                if written >= megabytes * 1e6:
                    break
    return text


def run_measured(code: str, env: dict | None = None) -> tuple[dict, float, float, float]:
    """Run `python -c code` (which prints one JSON line last); returns (result, seconds, peak tree RSS GB, peak one-process GB)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    peak_tree = peak_one = 0
    stop = threading.Event()

    def sample():
        nonlocal peak_tree, peak_one
        p = psutil.Process(proc.pid)
        while not stop.is_set():
            try:
                rss = [p.memory_info().rss] + [c.memory_info().rss for c in p.children(recursive=True)]
            except psutil.Error:
                rss = [0]
            peak_tree, peak_one = max(peak_tree, sum(rss)), max(peak_one, max(rss))
            stop.wait(0.05)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = proc.communicate()
    stop.set()
    th.join()
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"benchmark step failed (exit {proc.returncode}):\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1]), seconds, peak_tree / 2**30, peak_one / 2**30


def prepare_run(inp: Path, out: Path, tokenizer: str, num_proc: int) -> dict:
    code = (
        "import json, time\n"
        "from steadylm.data.prepare import prepare\n"
        "t = time.perf_counter()\n"
        f"s = prepare(input={str(inp)!r}, out_dir={str(out)!r}, tokenizer={tokenizer!r}, num_proc={num_proc}, progress=False)\n"
        "print(json.dumps({'seconds': time.perf_counter() - t, 'bytes': sum(s['bytes'].values()), "
        "'tokens': sum(s['tokens'].values())}))\n"
    )
    res, wall, tree, one = run_measured(code)
    shutil.rmtree(out, ignore_errors=True)
    return {**res, "mb_s": res["bytes"] / res["seconds"] / 1e6, "peak_tree_gb": tree, "peak_one_gb": one, "wall": wall}


def reference_encode(inp: Path, tok_json: Path, threads: int) -> dict:
    """tokenizers' own encode_batch over the same documents with `threads` threads (texts loaded beforehand)."""
    code = (
        "import json, time\n"
        "from tokenizers import Tokenizer\n"
        f"tok = Tokenizer.from_file({str(tok_json)!r})\n"
        f"texts = [json.loads(l)['text'] for l in open({str(inp)!r}, encoding='utf-8')]\n"
        "n = sum(len(t.encode()) for t in texts)\n"
        "t = time.perf_counter()\n"
        "for i in range(0, len(texts), 256):\n"
        "    tok.encode_batch(texts[i:i + 256], add_special_tokens=False)\n"
        "dt = time.perf_counter() - t\n"
        "print(json.dumps({'seconds': dt, 'bytes': n, 'mb_s': n / dt / 1e6}))\n"
    )
    env = {**ENV, "RAYON_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "true" if threads > 1 else "false"}
    return run_measured(code, env)[0]


def window_check_cost(inp: Path, work: Path) -> dict:
    """µs per window read with and without the vocabulary check (one max() over T+1 ids)."""
    code = (
        "import json, time, numpy as np\n"
        "from steadylm.data.prepare import prepare\n"
        "from steadylm.data.dataset import TokenWindows\n"
        f"s = prepare(input={str(inp)!r}, out_dir={str(work / 'win')!r}, max_bytes=20_000_000, num_proc=1, progress=False)\n"
        "ds = TokenWindows(s['shards']['train'], 1024, model_vocab_size=320)\n"
        "idx = np.random.default_rng(0).integers(0, len(ds), 20000).tolist()\n"
        "from steadylm.data.shards import open_tokens\n"
        "class Unchecked(TokenWindows):\n"
        "    def __getitem__(self, i):\n"
        "        s, off, k = self.locate(i)\n"
        "        if s not in self._handles:\n"
        "            self._handles[s] = open_tokens(self.paths[s])\n"
        "        w = np.asarray(self._handles[s][off : off + k + 1], np.int64)\n"
        "        return w[:-1], w[1:]\n"
        "raw = Unchecked(s['shards']['train'], 1024)\n"
        "res = {}\n"
        "for name, d in (('checked', ds), ('unchecked', raw), ('checked2', ds), ('unchecked2', raw)):\n"
        "    for i in idx[:500]: d[i]\n"
        "    t = time.perf_counter()\n"
        "    for i in idx: d[i]\n"
        "    res[name] = (time.perf_counter() - t) / len(idx) * 1e6\n"
        "w = np.zeros(1025, np.uint16)\n"
        "t = time.perf_counter()\n"
        "for _ in range(20000): int(w.max()) >= 320\n"
        "res['check_only'] = (time.perf_counter() - t) / 20000 * 1e6\n"
        "print(json.dumps(res))\n"
    )
    r = run_measured(code)[0]
    return {
        "checked": min(r["checked"], r["checked2"]),
        "unchecked": min(r["unchecked"], r["unchecked2"]),
        "check_only": r["check_only"],
    }


def best(run, repeats: int, previous: dict | None = None) -> dict:
    """The fastest of `repeats` runs (and `previous`); peak RSS is the largest seen."""
    results = [run() for _ in range(max(1, repeats))] + ([previous] if previous else [])
    top = dict(max(results, key=lambda r: r["mb_s"]))
    for key in ("peak_tree_gb", "peak_one_gb"):
        if key in top:
            top[key] = max(r[key] for r in results)
    return top


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a ~40 MB input (seconds), for CI and a first look")
    ap.add_argument(
        "--size-mb", type=float, default=None, help="input size for the bytes rows (default 1600, quick 40)"
    )
    ap.add_argument("--bpe-mb", type=float, default=None, help="input size for the BPE rows (default 48, quick 6)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per row (the fastest is reported)")
    ap.add_argument("--workdir", default=None, help="where to generate the input (default: a temporary folder)")
    args = ap.parse_args(argv)
    size = args.size_mb or (40 if args.quick else 1600)
    bpe_size = args.bpe_mb or (6 if args.quick else 48)
    n = cores()
    work = Path(tempfile.mkdtemp(prefix="steadylm-prepare-bench-", dir=args.workdir))
    try:
        print(f"prepare_bench: {n} core(s); generating a {size:.0f} MB .jsonl in {work}", file=sys.stderr, flush=True)
        big = work / "big.jsonl"
        make_input(big, size)
        procs = [1] if n == 1 else [1, n]
        bytes_runs = {}
        for p in procs:
            print(f"prepare_bench: bytes tokenizer, num_proc={p}", file=sys.stderr, flush=True)
            bytes_runs[p] = best(lambda p=p: prepare_run(big, work / f"out-bytes-{p}", "bytes", p), args.repeats)

        small = work / "bpe.jsonl"
        make_input(small, bpe_size)
        print("prepare_bench: training a BPE (vocab 8192) on the BPE input", file=sys.stderr, flush=True)
        sys.path.insert(0, str(ROOT / "src"))
        from steadylm.data.tokenizer import save_tokenizer, train_bpe

        texts = (json.loads(line)["text"] for line in open(small, encoding="utf-8"))
        tok_json = save_tokenizer(train_bpe(texts, 8192), work)
        bpe_runs, ref_runs = {}, {}
        for p in procs:
            print(
                f"prepare_bench: BPE, num_proc={p} and tokenizers encode_batch with {p} thread(s)",
                file=sys.stderr,
                flush=True,
            )
            # alternated, best of --repeats each: on a shared machine the load changes between runs
            for _ in range(args.repeats):
                bpe_runs[p] = best(
                    lambda p=p: prepare_run(small, work / f"out-bpe-{p}", str(tok_json), p), 1, bpe_runs.get(p)
                )
                ref_runs[p] = best(lambda p=p: reference_encode(small, tok_json, p), 1, ref_runs.get(p))
        print("prepare_bench: window check cost", file=sys.stderr, flush=True)
        win = window_check_cost(big, work)

        gb = os.path.getsize(big) / 1e9
        print(
            f"\n## prepare ({gb:.2f} GB .jsonl for bytes, {os.path.getsize(small) / 1e6:.0f} MB for BPE; {n} core(s); "
            "MB/s = UTF-8 text bytes per wall second of prepare, shards written)\n"
        )
        print(
            "| tokenizer | processes | prepare MB/s | per process | reference MB/s | prepare / reference | peak RSS tree / one process |"
        )
        print("|---|---|---|---|---|---|---|")
        for p in procs:
            r = bytes_runs[p]
            print(
                f"| bytes | {p} | {r['mb_s']:.1f} | {r['mb_s'] / p:.1f} | – | – | {r['peak_tree_gb']:.2f} / {r['peak_one_gb']:.2f} GB |"
            )
        for p in procs:
            r, ref = bpe_runs[p], ref_runs[p]
            print(
                f"| bpe 8192 | {p} | {r['mb_s']:.2f} | {r['mb_s'] / p:.2f} | {ref['mb_s']:.2f} (encode_batch, {p} thread(s)) "
                f"| {r['mb_s'] / ref['mb_s']:.2f} | {r['peak_tree_gb']:.2f} / {r['peak_one_gb']:.2f} GB |"
            )
        if len(procs) > 1:
            print(
                f"\nscaling 1 -> {n} cores: bytes x{bytes_runs[n]['mb_s'] / bytes_runs[1]['mb_s']:.2f}, "
                f"bpe x{bpe_runs[n]['mb_s'] / bpe_runs[1]['mb_s']:.2f} "
                f"(tokenizers encode_batch x{ref_runs[n]['mb_s'] / ref_runs[1]['mb_s']:.2f})"
            )
        print(
            f"\nwindow check (T=1024, random windows): read {win['unchecked']:.1f} µs, read + check {win['checked']:.1f} µs; "
            f"the check alone {win['check_only']:.2f} µs ({win['check_only'] / win['unchecked'] * 100:.1f}% of a read)"
        )
        peak = max(r["peak_tree_gb"] for r in list(bytes_runs.values()) + list(bpe_runs.values()))
        ratio = min(bpe_runs[p]["mb_s"] / ref_runs[p]["mb_s"] for p in procs)
        goals = [
            (
                f"bytes >= {GOALS['bytes_mb_s_per_process']:.0f} MB/s per process",
                bytes_runs[1]["mb_s"] >= GOALS["bytes_mb_s_per_process"],
            ),
            (f"bpe >= {GOALS['bpe_vs_tokenizers']}x tokenizers encode_batch", ratio >= GOALS["bpe_vs_tokenizers"]),
            (f"peak RSS < {GOALS['peak_rss_gb']:.0f} GB on a {gb:.2f} GB input", peak < GOALS["peak_rss_gb"]),
        ]
        print("\n" + "; ".join(f"{name}: {'met' if ok else 'NOT met'}" for name, ok in goals))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
