"""benchmarks/gpu.sh on the CPU: its side-by-side part runs in its CPU form, and every scenario it names exists.

The GPU numbers come from a lent GPU; what can break without one (the pairing, the table, the names the script
passes on) is checked here."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_sh_runs_the_divergence_benchs_cuda_scenario(monkeypatch, capsys):
    """gpu.sh's divergence line, parsed by the bench's own parser: it runs one scenario, a CUDA one, which the same
    line on a CPU skips (a renamed scenario, or a flag the bench lost, fails here)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import divergence_bench

    (line,) = [ln for ln in (ROOT / "benchmarks" / "gpu.sh").read_text().splitlines() if "divergence_bench.py" in ln]
    args = divergence_bench.arguments(shlex.split(line.split("divergence_bench.py", 1)[1]))
    (name,) = divergence_bench.chosen(args)
    assert args.device == "cuda" and divergence_bench.SCENARIOS[name][2] in divergence_bench.NEEDS_CUDA
    args.device = "cpu"
    assert divergence_bench.chosen(args) == {} and f"skipped: {name} needs a CUDA GPU" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="is no scenario"):
        divergence_bench.chosen(divergence_bench.arguments(["--only", "fp16 typo"]))
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu.sh")]).returncode == 0


@pytest.mark.slow
def test_side_by_side_cpu_form_prints_every_batch_and_loss():
    """One paired fit per micro-batch and loss path: the plain loop, `callbacks=minimal` and the suite each get
    tokens/s, and the two ratios to the plain loop an interval around their value; chunked / plain per batch."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--cpu", "--side-by-side", "--batches", "2,4"]
    proc = subprocess.run([*cmd, "--steps", "10"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^\s+(\d+) (chunked|plain)\s+(.*)$", proc.stdout, re.M)
    assert [(b, loss) for b, loss, _ in rows] == [("2", "chunked"), ("2", "plain"), ("4", "chunked"), ("4", "plain")]
    for *_, cells in rows:
        tps = [float(t.replace(",", "")) for t in re.findall(r"([\d,]+) \(\s*n/a\)", cells)]
        assert len(tps) == 3 and all(t > 0 for t in tps), cells
        for value, low, high in re.findall(r"([\d.]+) \[([\d.]+), ([\d.]+)\]", cells):
            assert float(low) <= float(value) <= float(high) and float(value) > 0, cells
    assert re.search(r"batch 2: [\d.]+ \[[\d.]+, [\d.]+\]\n  batch 4: [\d.]+ \[", proc.stdout), proc.stdout


def test_side_by_side_refuses_fewer_steps_than_a_bootstrap_run():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--cpu", "--side-by-side", "--steps", "5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--side-by-side needs --steps >= 10" in proc.stderr, proc.stderr[-2000:]
