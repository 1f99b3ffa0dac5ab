"""Sample text from a checkpoint: `python -m steadylm.generate ckpt=PATH 'prompt="def "' max_new_tokens=200`.

The checkpoint alone is enough: the model shape comes from `hyper_parameters.model` and the tokenizer
from `steadylm.tokenizer`, both written by training; `ckpt=` may also be a Hugging Face GPT-2 or Llama folder. It is loaded with `weights_only=True`, so a
checkpoint file can never run code. Same checkpoint, prompt and seed -> the same text.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch

from steadylm.checkpointing import CheckpointError, safe_load
from steadylm.cli import run_command
from steadylm.data.tokenizer import Tokenizer, tokenizer_of_run
from steadylm.errors import ConfigError, SteadyError
from steadylm.model import GPT, GPTConfig


@dataclass
class GenerateArgs:
    ckpt: str
    prompt: str = "\n"
    max_new_tokens: int = 200
    temperature: float = 0.8  # 0 = greedy
    top_k: int | None = 50  # sample only among the k most likely tokens; null = all
    seed: int = 0
    device: str = "auto"  # auto = cuda when available


def load_model(path: str | Path, device: str = "cpu") -> tuple[GPT, dict]:
    """The one loader of a trained model (`generate`, `export`, `eval`): (GPT in eval mode, `ckpt["steadylm"]`, which
    holds the run's `config` and `tokenizer`); the shape comes from `hyper_parameters.model`. A Hugging Face folder
    (GPT-2 or Llama, model/hf.py) is read as `model.init_from` reads it, its `tokenizer.json` as the tokenizer."""
    if Path(path).is_dir() and not (Path(path) / ".metadata").exists():  # .metadata: FSDP2's distributed checkpoint
        return load_pretrained_folder(path, device)
    try:
        ckpt = safe_load(path, map_location=device)
    except CheckpointError as e:
        raise SteadyError(f"ckpt={e}") from None
    try:
        model_cfg, meta = ckpt["hyper_parameters"]["model"], ckpt["steadylm"]
        state = {k.removeprefix("net."): v for k, v in ckpt["state_dict"].items() if k.startswith("net.")}
    except (KeyError, TypeError, AttributeError) as e:
        raise SteadyError(
            f"ckpt={Path(path)}: not a steadylm training checkpoint (missing {e}); pass one written by train.py"
        ) from None
    model = GPT(GPTConfig(**model_cfg))
    model.load_state_dict(state)
    model.doc_separator = ckpt["hyper_parameters"].get("doc_separator")  # data.pack=doc: as the run trained
    return model.to(device).eval(), meta


def load_pretrained_folder(path: str | Path, device: str = "cpu") -> tuple[GPT, dict]:
    """`load_model` of a Hugging Face folder: its meta names the folder's tokenizer.json, which it must have."""
    from steadylm.model.hf import load_pretrained, model_values, tokenizer_file

    try:
        model = GPT(GPTConfig(**model_values(path), init_from=str(path)))
    except ConfigError as e:
        raise SteadyError(str(e).replace("model.init_from=", "ckpt=")) from None
    if (tok := tokenizer_file(path)) is None:
        raise SteadyError(f"ckpt={path}: no tokenizer.json there; the model's tokenizer must be beside its weights")
    load_pretrained(model, path)
    return model.to(device).eval(), {"tokenizer": str(tok)}


def load_checkpoint(path: str | Path, device: str = "cpu") -> tuple[GPT, Tokenizer]:
    """Rebuild the GPT and its tokenizer from a training checkpoint."""
    model, meta = load_model(path, device)
    return model, tokenizer_of_run(meta)  # bpe: the tokenizer.json prepare saved in the run's data.dir


@torch.no_grad()
def sample(
    model: GPT,
    ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    vocab_size: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Append up to `max_new_tokens` sampled ids to `ids`; returns only the new ones.

    `vocab_size` masks the padding ids above the tokenizer's vocabulary, which the model was never
    trained to emit. The context is cropped to the model's last `context_length` tokens.
    """
    device = next(model.parameters()).device
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(idx[:, -model.cfg.context_length :])[0, -1].float()
        if vocab_size is not None:
            logits[vocab_size:] = -float("inf")
        if temperature <= 0:
            nxt = logits.argmax()
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits[logits < kth] = -float("inf")
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[0]
        new.append(int(nxt))
        idx = torch.cat([idx, nxt.view(1, 1)], dim=1)
    return new


def generate(args: GenerateArgs) -> str:
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model, tok = load_checkpoint(args.ckpt, device)
    ids = tok.encode(args.prompt) or [tok.eos_id]
    generator = torch.Generator(device=device).manual_seed(args.seed)
    new = sample(model, ids, args.max_new_tokens, args.temperature, args.top_k, tok.vocab_size, generator)
    return args.prompt + tok.decode(new)


def main(argv: list[str] | None = None) -> None:
    def task(cfg) -> None:
        keys = {f.name for f in fields(GenerateArgs)}
        print(generate(GenerateArgs(**{k: v for k, v in cfg.items() if k in keys and k != "hydra"})))

    run_command("generate", __doc__, task, argv)


if __name__ == "__main__":
    main()
