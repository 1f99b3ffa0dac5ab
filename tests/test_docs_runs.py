"""The commands of docs/*.md that a user would copy, run as tests/test_readme_runs.py runs the README's: in order, in
one fresh folder, made small the same way. A command the README block already runs is not run again; one that
cannot run here, or whose path another test runs, is in `NOT_RUN` (the command, or the words it starts with) with
the reason."""

from __future__ import annotations

import re

import pytest

from tests.helpers import ROOT, run_cli
from tests.test_readme_runs import everyday_commands, newcomer_folder, run_as_written, small

NOT_RUN = {
    "python -m steadylm.doctor model=small trainer.devices=4": "the README's doctor line runs the same checks on 1 device",
    "make tensorboard": "starts a server that runs until stopped; test_tensorboard.py reads the files it serves",
    "python -m steadylm.eval.fetch": "downloads HellaSwag (no network in tests); test_eval.py covers its refusal",
    "make bench": "the benchmarks take minutes; test_model_bench.py and test_perf.py run their quick forms",
    "benchmarks/gpu.sh": "needs a CUDA GPU; test_gpu_bench.py runs its CPU form",
    "python train.py -m optim.lr=1e-3,2e-3,3e-3,4e-3 hydra/launcher=parallel": "the README's parallel sweep runs "
    "the same path; test_parallel.py runs 4 jobs on 2 slots",
    "python train.py experiment=gpt2_124m": "the README runs the recipe on 2 processes, and "
    "test_machine_size.py resumes a 2-rank checkpoint on 1 rank and a 1-rank one on 2",
    "python train.py -m optim.lr=1e-3,2e-3 trainer=ddp_sim": "the README's sweep on N devices runs the same jobs",
    "python benchmarks/parallel_sweep_bench.py": "a benchmark of minutes; test_parallel.py runs the parallel sweep",
    "python train.py -m model=small model.parametrization=mup": "12 jobs of the sweep path the README runs",
    "python train.py -m hydra/launcher=slurm": "needs a SLURM cluster",
    "srun": "needs a SLURM cluster",
    "python -m steadylm.data.prepare data.input=my_texts/ data.tokenizer=models/gpt2": "needs a published model "
    "folder (no network in tests); test_continue_pretraining.py runs prepare -> train -> generate on a random GPT-2",
    "python train.py experiment=continue model.init_from=models/gpt2": "the published model, as above",
    "python -m steadylm.generate ckpt=logs/mine/checkpoints/last.ckpt": "the run above",
}


def docs_commands() -> list[tuple[str, str]]:
    """(page, line) of every fenced bash line of docs/, comments cut, in page order."""
    out = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            out += [(page.name, line.split("  #")[0].strip()) for line in block.splitlines()]
    return [(page, line) for page, line in out if line and not line.startswith("#")]


def to_run() -> list[tuple[str, str]]:
    readme = set(everyday_commands((ROOT / "README.md").read_text()))
    skipped = lambda line: line in readme or any(line == p or line.startswith(p + " ") for p in NOT_RUN)
    return [(page, line) for page, line in docs_commands() if not skipped(line)]


def test_every_docs_command_is_run_or_skipped_with_a_reason():
    runs = [line for _, line in to_run()]
    assert all(line.startswith("python ") for line in runs), runs  # what is left is ours to run
    assert len(runs) >= 8 and not [
        p for p in NOT_RUN if not any(line == p or line.startswith(p + " ") for _, line in docs_commands())
    ], runs


@pytest.mark.slow
def test_every_docs_command_runs_in_order(tmp_path):
    newcomer_folder(tmp_path)
    for name in ("notes", "code"):  # data.md's mixture reads two folders of the user's own text
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.txt").write_text(f"{name}: the quick brown fox jumps over the lazy dog.\n" * 600)
    args, _ = small("python train.py hydra.run.dir=logs/demo")  # make demo's run, which the tool lines read
    assert run_cli(*args, cwd=tmp_path).returncode == 0
    for page, line in to_run():
        run_as_written(tmp_path, line, page)
