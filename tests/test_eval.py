"""Multiple-choice evaluation: task files in both formats, lm-eval's scoring rules, the validation-time callback
(`eval/<task>/acc_norm` equals the scorer on the final weights), and lm-eval itself agreeing with our scorer."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from steadylm.data.tokenizer import ByteTokenizer, tokenizer_of_run
from steadylm.errors import SteadyError
from steadylm.eval.fetch import fetch
from steadylm.eval.score import correct, encode_pair, score
from steadylm.eval.tasks import load_task
from steadylm.generate import load_checkpoint, load_model
from steadylm.model.gpt import chunked_token_losses
from tests.helpers import run_cli

HELLASWAG_ROW = {
    "activity_label": "Removing ice from car",
    "ctx_a": "Then, the man writes over the snow covering the window of a car, and a woman wearing winter clothes smiles.",
    "ctx_b": "then",
    "endings": [", the man adds wax to the windshield and cuts it.", ", a person board a ski lift [title] ok."],
    "label": 1,
}


def write_generic(path, n=12, seed=0):
    """Python-ish items with choices of different lengths, so acc and acc_norm can disagree."""
    rng = random.Random(seed)
    words = ["return x", "pass", "import os", "self.value = None", "yield", "raise ValueError('no')", "x += 1"]
    with path.open("w") as f:
        for i in range(n):
            choices = rng.sample(words, 4)
            f.write(json.dumps({"context": f"def f{i}(x):\n   ", "choices": choices, "label": rng.randrange(4)}) + "\n")
    return path


def test_hellaswag_rows_are_read_as_lm_eval_reads_them(tmp_path):
    path = tmp_path / "hellaswag_val.jsonl"
    path.write_text(json.dumps(HELLASWAG_ROW) + "\n")
    task = load_task(f"hs={path}")
    item = task.items[0]
    assert task.name == "hs" and item.label == 1
    assert item.context.startswith("Removing ice from car: Then, the man") and item.context.endswith("smiles. Then")
    assert item.choices == (", the man adds wax to the windshield and cuts it.", ", a person board a ski lift. ok.")
    assert load_task(str(write_generic(tmp_path / "mc.jsonl")), limit=5).name == "mc"
    assert len(load_task(str(tmp_path / "mc.jsonl"), limit=5).items) == 5


@pytest.mark.parametrize(
    "row,match",
    [({"context": "a", "choices": ["b"]}, "mc.jsonl:1"), ({"context": "a", "choices": ["b"], "label": 3}, "label 3")],
)
def test_a_bad_task_file_is_one_error_naming_the_line(tmp_path, row, match):
    (tmp_path / "mc.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(SteadyError, match=match):
        load_task(str(tmp_path / "mc.jsonl"))


def test_pairs_move_trailing_spaces_and_scores_pick_argmax():
    tok = ByteTokenizer()
    ctx, cont = encode_pair(tok, "ab  ", " c")
    assert tok.decode(ctx) == "ab" and tok.decode(cont) == "   c"
    assert encode_pair(tok, "", "x")[0] == [tok.eos_id]
    items = [load_item("c", ["a long right one", "no"], 0)]
    # "no" wins on the summed log-likelihood (acc wrong), the long one per character (acc_norm right)
    assert correct(items, [-8.0, -5.0]) == (0, 1)


def load_item(context, choices, label):
    from steadylm.eval.tasks import Item

    return Item(context, tuple(choices), label)


def test_fetch_without_network_is_one_clear_error(tmp_path, monkeypatch):
    import urllib.request

    def offline(*a, **k):
        raise urllib.error.URLError("network unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(SteadyError, match="cannot download .*hellaswag_val.jsonl.*by hand"):
        fetch("hellaswag", tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def eval_run(shards_dir, tmp_path_factory):
    """A tiny run with the eval callback on, validating at its last step."""
    from steadylm.config import compose
    from steadylm.train import train

    out = tmp_path_factory.mktemp("eval_run")
    task = write_generic(out / "mc.jsonl")
    cfg = compose(
        [
            "trainer=cpu",
            "trainer.precision=32-true",
            "model.n_layer=1",
            "model.d_model=32",
            "model.n_head=2",
            "model.context_length=32",
            "data.batch_size=4",
            "trainer.max_steps=4",
            "trainer.val_check_interval=4",
            "data.val_windows=4",
            "trainer.enable_progress_bar=false",
            "optim.warmup_steps=1",
            "callbacks=minimal",
            f"callbacks.eval.tasks=[{task}]",
            "callbacks.eval.limit=10",
            "callbacks.eval.batch_size=7",
            f"data.dir={shards_dir}",
            f"paths.output_dir={out / 'run'}",
        ]
    )
    metrics, _ = train(cfg)
    return metrics, out / "run" / "checkpoints" / "last.ckpt", task


def own_score(ckpt, task_path, limit=None):
    net, meta = load_checkpoint_meta(ckpt)
    tok = tokenizer_of_run(meta)
    items = load_task(str(task_path), limit).items
    losses = lambda x, y: chunked_token_losses(net(x, head=False), net.lm_head.weight, y, chunk=16)  # noqa: E731
    with torch.no_grad():
        acc, acc_norm = score(losses, tok, items, net.cfg.context_length, batch_size=5)
    return acc / len(items), acc_norm / len(items)


def load_checkpoint_meta(ckpt):
    net, meta = load_model(ckpt, "cpu")
    return net.eval(), meta


def test_validation_logs_eval_accuracy_equal_to_the_scorer_on_the_final_weights(eval_run):
    metrics, ckpt, task = eval_run
    acc, acc_norm = own_score(ckpt, task, limit=10)
    assert metrics["eval/mc/acc"] == pytest.approx(acc)
    assert metrics["eval/mc/acc_norm"] == pytest.approx(acc_norm)
    assert load_checkpoint(ckpt)  # the run wrote its checkpoint after the eval


@pytest.mark.slow
def test_lm_eval_on_a_checkpoint_equals_our_scorer(eval_run, tmp_path, monkeypatch, capsys):
    pytest.importorskip("lm_eval")
    from steadylm.eval.harness import main

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # the command sets them for local tasks; undone after
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    _, ckpt, task = eval_run
    main([f"ckpt={ckpt}", f'tasks=["mc={task}"]', "device=cpu", f"out={tmp_path / 'r.json'}"])
    assert os.environ["HF_DATASETS_OFFLINE"] == os.environ["HF_HUB_OFFLINE"] == "1"  # local tasks: no network
    results = json.loads((tmp_path / "r.json").read_text())["mc"]
    acc, acc_norm = own_score(ckpt, task)
    assert results["acc,none"] == pytest.approx(acc)
    assert results["acc_norm,none"] == pytest.approx(acc_norm)
    assert "mc" in capsys.readouterr().out


@pytest.mark.slow
def test_lm_eval_refuses_a_choice_longer_than_the_context_in_one_line(eval_run, tmp_path):
    """lm-eval asserts (a traceback) on a choice that does not fit the model's 32 positions: one line, exit 2."""
    pytest.importorskip("lm_eval")
    _, ckpt, _ = eval_run
    row = {"context": "Pick one:", "choices": ["short", "x" * 40], "label": 0}
    (tmp_path / "long.jsonl").write_text(json.dumps(row) + "\n")
    done = run_cli(f"ckpt={ckpt}", f"tasks=[{tmp_path / 'long.jsonl'}]", cwd=tmp_path, module="steadylm.eval")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "error: eval task long, item 1: a choice is 41 tokens, and the model sees 32 at once" in done.stderr


@pytest.mark.slow
def test_lm_eval_on_a_hugging_face_folder_equals_our_scorer(tmp_path, monkeypatch):
    """`ckpt=` a Hugging Face folder (a random GPT-2 saved by transformers): lm-eval on it, through the export, scores
    what our scorer gives the imported model."""
    pytest.importorskip("lm_eval")
    from steadylm.eval.harness import main
    from tests.test_import_hf import make_folder

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    folder, task = make_folder(tmp_path / "gpt2", "gpt2"), write_generic(tmp_path / "mc.jsonl")
    main([f"ckpt={folder}", f'tasks=["mc={task}"]', "device=cpu", f"out={tmp_path / 'r.json'}"])
    results = json.loads((tmp_path / "r.json").read_text())["mc"]
    acc, acc_norm = own_score(folder, task)
    assert results["acc,none"] == pytest.approx(acc)
    assert results["acc_norm,none"] == pytest.approx(acc_norm)
