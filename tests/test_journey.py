"""A new user's first hour as one test: a folder of text -> prepare -> train -> generate -> export -> transformers.

Every step is the real command in a subprocess, given only the keys a newcomer types: the folder, the data dir
(then the exact train command `prepare` printed, plus `trainer.max_steps`), the checkpoint and the export
folder. A key that becomes necessary, a noisy console or a missing file in the run folder fails it.
"""

from __future__ import annotations

import json
import random
import shlex

import pytest

from steadylm.derived import padded_vocab
from tests.helpers import run_cli

transformers = pytest.importorskip("transformers")

WORDS = "the a model loss step token text learns reads writes slowly fast data run each one of every".split()
NOISE = ("Tip:", "litlogger", "LeafSpec", "Warning", "warning", "Traceback")


def _corpus(folder, n_files: int = 10) -> None:
    """Ten text files of made-up sentences, of very different sizes (one holds most of the text)."""
    rng = random.Random(0)
    folder.mkdir()
    for i in range(n_files):
        n = 3000 if i == 0 else 150
        sentences = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() for _ in range(n))
        (folder / f"doc{i}.txt").write_text(". ".join(sentences) + ".\n")


def _quiet(out: str) -> None:
    assert not [w for w in NOISE if w in out], out


@pytest.mark.slow
def test_a_folder_of_text_to_a_transformers_model(tmp_path):
    _corpus(tmp_path / "corpus")

    done = run_cli(
        "data.input=corpus", "data.dir=data/mine", "data.tokenizer=bpe", cwd=tmp_path, module="steadylm.data.prepare"
    )
    assert done.returncode == 0, done.stderr
    _quiet(done.stdout)
    command = done.stdout.split("train on it: ")[1].splitlines()[0]
    assert command == "python train.py data.dir=data/mine"
    split = done.stdout.split("split: ")[1]
    assert "(1.00%; data.val_fraction=0.01)" in split  # of the tokens, though doc0 holds most of the text

    done = run_cli(*shlex.split(command)[2:], "trainer.max_steps=10", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    console = done.stdout + done.stderr
    _quiet(console)
    assert "step 10/10 | loss " in console and "stability: ok" in console and "val  10/10 | loss " in console
    (run,) = (tmp_path / "logs" / "train" / "runs").iterdir()
    log = (run / "train.log").read_text()
    assert "step 10/10 | loss " in log and "`Trainer.fit` stopped" in log
    assert (run / "stability" / "events.jsonl").read_text() == ""
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "ok" and result["val_loss"] is not None

    ckpt = str(run / "checkpoints" / "last.ckpt")
    done = run_cli(f"ckpt={ckpt}", "max_new_tokens=20", cwd=tmp_path, module="steadylm.generate")
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    done = run_cli(f"ckpt={ckpt}", "out=exported", cwd=tmp_path, module="steadylm.export")
    assert done.returncode == 0, done.stderr

    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "exported")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    assert model.config.vocab_size == padded_vocab(len(tok))  # the BPE's ids (<= 512 here), padded to 64
    ids = tok("The model", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=5, do_sample=False).shape[1] == ids.shape[1] + 5
