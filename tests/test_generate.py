"""Sampling from a real (tiny) training checkpoint: rebuilt from the file alone, seeded, bounded."""

import pytest
import torch

from steadylm.config import compose
from steadylm.generate import GenerateArgs, generate, load_checkpoint, main, sample
from steadylm.train import train

CTX = 32


@pytest.fixture(autouse=True)
def one_thread():
    """Batch-1 sampling of a tiny model is all overhead; extra threads only contend on a busy CI box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ckpt(shards_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gen_run")
    cfg = compose(
        [
            "trainer=cpu",
            "model.n_layer=1",
            "model.n_head=2",
            "model.d_model=32",
            f"model.context_length={CTX}",
            "data.batch_size=4",
            "trainer.max_steps=4",
            "optim.warmup_steps=1",
            "trainer.val_check_interval=4",
            "data.val_windows=4",
            "trainer.enable_progress_bar=false",
            f"data.dir={shards_dir}",
            f"paths.output_dir={out}",
        ]
    )
    train(cfg)
    return out / "checkpoints" / "last.ckpt"


def test_model_and_tokenizer_come_from_the_checkpoint_alone(ckpt):
    model, tok = load_checkpoint(ckpt)
    assert tok.name == "bytes"
    assert model.cfg.context_length == CTX and model.cfg.n_layer == 1
    trained = torch.load(ckpt, weights_only=True)["state_dict"]["net.wte.weight"]
    assert torch.equal(model.wte.weight, trained)


def test_same_seed_same_text_and_max_new_tokens_respected(ckpt):
    args = dict(ckpt=str(ckpt), prompt="def ", max_new_tokens=40, temperature=0.8, top_k=50)
    a, b = generate(GenerateArgs(**args, seed=0)), generate(GenerateArgs(**args, seed=0))
    assert a == b and a.startswith("def ")
    assert generate(GenerateArgs(**args, seed=1)) != a
    model, tok = load_checkpoint(ckpt)
    long_prompt = tok.encode("x" * (3 * CTX))  # longer than the context: cropped, not refused
    new = sample(model, long_prompt, 25, generator=torch.Generator().manual_seed(0), vocab_size=tok.vocab_size)
    assert len(new) == 25 and all(0 <= i < tok.vocab_size for i in new)  # padding ids never sampled
    assert sample(model, long_prompt, 0) == []


def test_top_k_1_is_greedy(ckpt):
    model, tok = load_checkpoint(ckpt)
    ids = tok.encode("import ")
    greedy = sample(model, ids, 10, temperature=0)
    assert sample(model, ids, 10, temperature=0.8, top_k=1, generator=torch.Generator().manual_seed(3)) == greedy


def test_cli_prints_prompt_and_sample(ckpt, capsys):
    main([f"ckpt={ckpt}", 'prompt="def "', "max_new_tokens=20", "temperature=0.8", "top_k=50", "seed=0", "device=cpu"])
    out = capsys.readouterr().out
    assert out.startswith("def ") and len(out.encode()) <= len("def ") + 20 * 3 + 1  # ≤ 20 bytes, some replaced


@pytest.mark.parametrize(
    "argv,message",
    [
        (["ckpt=/nowhere/last.ckpt"], "error: ckpt=/nowhere/last.ckpt: checkpoint file not found"),
        (["prompt=hi"], "error: ckpt= is required"),
        (["ckpt=x", "tokens=5"], "error: tokens is not a config key"),
        (["ckpt=x", "max_new_tokens=many"], "error: max_new_tokens='many' is not allowed; it must be a whole number"),
    ],
)
def test_user_mistakes_are_one_message_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith(message)


def test_a_file_that_is_not_a_checkpoint_is_named(tmp_path, capsys):
    bad = tmp_path / "notes.ckpt"
    bad.write_text("not a checkpoint")
    with pytest.raises(SystemExit):
        main([f"ckpt={bad}"])
    assert f"error: ckpt={bad}: not a complete checkpoint (truncated or corrupt)" in capsys.readouterr().err
