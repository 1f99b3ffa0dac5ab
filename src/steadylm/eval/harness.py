"""`python -m steadylm.eval ckpt=PATH tasks=[...]`: lm-eval (the harness papers report with) on a checkpoint.

The checkpoint goes through `steadylm.export` into a temporary Hugging Face folder, which lm-eval loads with its
own `hf` model: the numbers are lm-eval's, not a re-implementation's. A local task file (HellaSwag's format or the
generic `{"context","choices","label"}`) is rewritten as generic jsonl in the same folder, with a task YAML that
reads it through `datasets`' `json` loader (`dataset_path: json`, `data_files`), so nothing is downloaded; any
other name is an lm-eval task (which fetches its data). Needs `pip install lm-eval` (the `eval` extra).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from steadylm.errors import SteadyError
from steadylm.eval.tasks import load_task

METRICS = ("acc", "acc_norm")


def task_yaml(name: str, data: Path) -> str:
    """An lm-eval multiple-choice task over a local generic jsonl file."""
    metrics = "".join(f"  - metric: {m}\n    aggregation: mean\n    higher_is_better: true\n" for m in METRICS)
    return (
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        f"metric_list:\n{metrics}metadata:\n  version: 1.0\n"
    )


def is_local(spec: str) -> bool:
    """A task file (PATH or NAME=PATH) rather than an lm-eval task name."""
    return spec.endswith(".jsonl") or "=" in spec or Path(spec).is_file()


def local_tasks(specs: list[str], folder: Path) -> list[str]:
    """Write each local task file as generic jsonl + a task YAML into `folder`; returns every task's lm-eval name."""
    names = []
    for spec in specs:
        if not is_local(spec):
            names.append(spec)  # an lm-eval task name
            continue
        task = load_task(spec)
        data = folder / f"{task.name}.jsonl"
        with data.open("w", encoding="utf-8") as f:
            for item in task.items:
                row = {"context": item.context, "choices": list(item.choices), "label": item.label}
                f.write(json.dumps(row) + "\n")
        (folder / f"{task.name}.yaml").write_text(task_yaml(task.name, data))
        names.append(task.name)
    return names


def check_fits(specs: list[str], limit: int | None, model_dir: Path) -> None:
    """lm-eval scores each choice inside one window of the model and asserts (a traceback) when a choice's tokens
    do not fit it: the first such item is one line here instead."""
    from transformers import AutoConfig, AutoTokenizer

    config, tok = AutoConfig.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    window = getattr(config, "n_positions", None) or config.max_position_embeddings
    for spec in specs:
        task = load_task(spec, limit)
        for n, item in enumerate(task.items, 1):
            longest = max(len(tok.encode(" " + c, add_special_tokens=False)) for c in item.choices)
            if longest >= window:
                raise SteadyError(
                    f"eval task {task.name}, item {n}: a choice is {longest} tokens, and the model sees {window} at "
                    "once; lm-eval needs each choice inside the context: evaluate a model with a longer "
                    "model.context_length, or a task with shorter choices"
                )


def run_lm_eval(
    ckpt: str, tasks: list[str], limit: int | None = None, batch_size: int = 16, device: str = "auto"
) -> dict:
    """lm-eval's results dict for `tasks` on the checkpoint; `results[task]["acc,none"]` etc."""
    if all(is_local(t) for t in tasks):
        # Nothing to download: never wait on a network that is not there (read when `datasets` is imported).
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise SteadyError("lm-eval is not installed: pip install 'steadylm[eval]' (or pip install lm-eval)") from None
    from steadylm.export import ExportArgs, export

    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory(prefix="steadylm-eval-") as tmp:
        model_dir, task_dir = Path(tmp) / "hf", Path(tmp) / "tasks"
        task_dir.mkdir()
        export(ExportArgs(ckpt=ckpt, out=str(model_dir)))
        check_fits([t for t in tasks if is_local(t)], limit, model_dir)
        names = local_tasks(tasks, task_dir)
        out = lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={model_dir},dtype=float32",
            tasks=names,
            task_manager=TaskManager(include_path=str(task_dir)),
            limit=limit,
            batch_size=batch_size,
            device=device,
        )
    return out["results"]


def main(argv: list[str] | None = None) -> None:
    from steadylm.cli import run_command

    def task(cfg) -> None:
        tasks = [cfg.tasks] if isinstance(cfg.tasks, str) else [str(t) for t in cfg.tasks]
        results = run_lm_eval(cfg.ckpt, tasks, cfg.limit, cfg.batch_size, cfg.device)
        print(f"{'task':24} {'acc':>7} {'acc_norm':>9}")
        for name, r in results.items():
            print(f"{name:24} {r.get('acc,none', float('nan')):7.4f} {r.get('acc_norm,none', float('nan')):9.4f}")
        if cfg.out:
            Path(cfg.out).write_text(json.dumps(results, indent=2, default=str) + "\n")
            print(f"results: {cfg.out}", file=sys.stderr)

    run_command("eval", __doc__.split("\n\n")[0], task, argv)
