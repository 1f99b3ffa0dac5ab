"""The README's "Everyday commands", run as a newcomer runs them: every line as written, in order, in one fresh folder,
each exiting 0 with no traceback and leaving what it promises. Editing a README line changes what runs here.

`small()` is the only thing added to a line, and only what makes it small: a step count, 16 val windows and a
1-layer model (a line's own preset and settings stay), 2 CPU processes (`trainer=ddp_sim`, or `fsdp_sim` for
`trainer=fsdp`) where the line asks for N GPUs, and for a recipe the embedded corpus instead of its own dataset, no
compile, and a warmup and validation interval made for the short run. Before the block, the folder gets what a
newcomer's `make demo` / `make data` and their own files give: the prepared embedded corpus, a folder of text
(`corpus/`) and an eval task file; `logs/demo` (make demo's run, which a tool line reads) is the run the resume line
made.
`tests/test_docs_runs.py` does the same for the commands of docs/.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from tests.helpers import ROOT, run_cli

TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.context_length=32"]
TINY += ["model.n_kv_head=null", "model.mlp_hidden=null"]  # a preset's own (llama_1b's 8 of 32 heads, 8192 wide)
CPU_TWIN = {"trainer=fsdp": "trainer=fsdp_sim", "trainer=ddp": "trainer=ddp_sim", "trainer=gpu": "trainer=ddp_sim"}
SHORT = ["data.batch_size=4", "trainer.max_steps=4", "trainer.log_every_n_steps=2", "data.val_windows=16"]
RECIPE = ["data.tokenizer=null", "data.dir=data/stdlib-bytes", "data.global_batch_tokens=256", "compile=false"]
RECIPE += ["optim.warmup_steps=1", "trainer.val_check_interval=2"]  # its own are for 19,073 steps
GPU_RECIPES = ("experiment=gpt2_124m", "experiment=llama_124m")  # their own dataset (FineWeb) and compile
NOT_RUN = {"make tensorboard": "starts a server that runs until stopped; test_tensorboard.py reads the files it serves"}
HELLASWAG = {
    "ctx_a": "A man is sitting on a roof.",
    "ctx_b": "he",
    "endings": ["wraps skis.", "pulls up the roof.", "runs.", "eats."],  # each choice inside the 32 positions
    "label": "1",
    "activity_label": "Roof shingle removal",
}


def everyday_commands(readme: str) -> list[str]:
    """The lines of the fenced block under '## Everyday commands', comments cut."""
    section = readme.split("## Everyday commands", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def small(line: str) -> tuple[list[str], str | None]:
    """A README line as argv with what makes it small appended, and the module it runs (None: train.py)."""
    words = shlex.split(line)
    assert words[0] == "python", line
    if words[1] == "-m":
        module, args = words[2], words[3:]
        if module == "steadylm.doctor":
            return [*args, *TINY, *SHORT, "probe.steps=6"], module
        if module == "steadylm.generate":
            return [*args, "max_new_tokens=8"], module
        if module == "steadylm.eval":
            return [*args, "limit=4"], module
        if module == "steadylm.diagnose":
            return args, module
        return args, module  # prepare, export: small already
    args = words[2:]
    gpus = [a for a in args if re.fullmatch(r"trainer\.devices=\d+", a) and int(a.split("=")[1]) > 1]
    if gpus:  # its trainer's 2-CPU-process twin (the line's own group, else DDP)
        args = [CPU_TWIN.get(a, a) for a in args if a not in gpus]
        args += [] if any(a.startswith("trainer=") for a in args) else ["trainer=ddp_sim"]
    if any(a in GPU_RECIPES for a in args):
        args += RECIPE
    return [*args, *TINY, *SHORT], None


def newcomer_folder(tmp: Path) -> None:
    """What a newcomer has before the block: the embedded corpus prepared (`make data`), their own text, a task."""
    done = run_cli(cwd=tmp, module="steadylm.data.prepare")
    assert done.returncode == 0, done.stderr
    (tmp / "corpus").mkdir()
    for i in range(3):
        (tmp / "corpus" / f"notes{i}.txt").write_text(f"Note {i}: the quick brown fox jumps over the lazy dog.\n" * 400)
    (tmp / "data" / "eval").mkdir(parents=True)
    (tmp / "data" / "eval" / "hellaswag_val.jsonl").write_text(json.dumps(HELLASWAG) + "\n")


def promised(tmp: Path, line: str, before: set[Path]) -> None:
    """What the line says it leaves behind exists (new run folders with their result, the export, the report)."""
    runs = {p.parent for p in tmp.glob("logs/**/result.json")} - before
    if "train.py" in line:
        assert runs, f"{line}: no new run folder with a result.json"
        for run in runs:
            result = json.loads((run / "result.json").read_text())
            assert result["status"] in ("ok", "unstable"), (line, result)
            assert (run / "config.yaml").is_file(), run
            if "ckpt_path=" not in line:  # a resume of a finished run has no step left to checkpoint
                assert (run / "checkpoints" / "last.ckpt").exists(), run  # a file, or FSDP2's folder
        if " -m " in line:
            assert list(tmp.glob("logs/train/multiruns/*/summary.md")), line
    if "steadylm.data.prepare" in line:
        out = re.search(r"data\.dir=(\S+)", line).group(1)
        assert list((tmp / out).glob("train-*.h5")) and list((tmp / out).glob("val-*.h5")), out
    if "steadylm.export" in line:
        out = re.search(r"out=(\S+)", line).group(1)
        assert (tmp / out / "config.json").is_file() and list((tmp / out).glob("*.safetensors")), out
    if "steadylm.diagnose" in line:
        assert (tmp / line.split()[-1] / "report.md").is_file()


def run_as_written(tmp: Path, line: str, where: str = "README") -> None:
    """`line`, made small, in `tmp`: exit 0, no traceback, and what it promises on disk."""
    args, module = small(line)
    before = {p.parent for p in tmp.glob("logs/**/result.json")}
    done = run_cli(*args, cwd=tmp, module=module, timeout=600)
    console = done.stdout + done.stderr
    assert done.returncode == 0 and "Traceback" not in console, f"{where}: {line}\n{console[-3000:]}"
    promised(tmp, line, before)


@pytest.mark.slow
def test_every_readme_command_runs_in_order(tmp_path):
    lines = everyday_commands((ROOT / "README.md").read_text())
    assert len(lines) >= 15, lines
    newcomer_folder(tmp_path)
    ran = []
    for line in lines:
        if any(line.startswith(prefix) for prefix in NOT_RUN):
            continue
        line = line.replace("logs/demo", "logs/run1")  # make demo's run: the resume line's run stands in for it
        run_as_written(tmp_path, line)
        ran.append(line)
    assert any("hydra/launcher=parallel" in line for line in ran) and any("data.sources" in line for line in ran)
