"""The data behind a loss spike: each sample's own loss on the pre-spike weights, and where it lives on disk.

`sample_losses` re-runs a step's micro-batches without gradients (on the live weights, or on a snapshot's
host copy through `torch.func.functional_call`, which leaves the live model untouched) and returns one
token-mean cross-entropy per sequence. `write_suspects` appends them, worst first, to
`<run_dir>/stability/suspects.jsonl`: one row per window with `step`, `rank`, `source` (under `data.sources`), `shard` (file name),
`start`/`end` token offsets (the window is `tokens[start:end]` of that shard), `loss` and a short decoded
preview. `python -m steadylm.diagnose.window shard=PATH start=N end=M` prints a window's text.
Runs only on the failure path (a spike); its host reads do not matter there. Each rank writes its own rows
(file appends are line-sized), so the samples of every rank are ranked.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

from steadylm.distributed import is_sharded, reshard
from steadylm.model.gpt import IGNORE_INDEX
from steadylm.stability.events import stability_dir

PREVIEW_CHARS = 160
TOP_SUSPECTS = 3


class _TargetLosses(torch.nn.Module):
    """The module's per-target losses as a forward, so `functional_call` can run them on a snapshot's weights."""

    def __init__(self, lm) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.lm.target_losses(x, y)


@torch.no_grad()
def sample_losses(pl_module, batches: list, weights=None) -> list[tuple[int, int, float]]:
    """(micro-batch, row, mean loss over the row's valid targets) for every non-padding row of `batches`.

    `weights`: a `recovery.Snapshot` whose host weights to use instead of the live ones (None: live). The losses
    come from `target_losses`: the configured head + loss path (chunked by default, no whole logits).
    """
    run = pl_module.target_losses
    if weights is not None:
        names = [n for n, _ in pl_module.named_parameters()] + [n for n, _ in pl_module.named_buffers()]
        device = next(pl_module.parameters()).device
        state = {f"lm.{n}": t.to(device) for n, t in zip(names, weights.weights())}
        run = lambda x, y: torch.func.functional_call(_TargetLosses(pl_module), state, (x, y))  # noqa: E731
    rows = []
    was_training = pl_module.training
    pl_module.eval()
    try:
        for mi, (x, y) in enumerate(batches):
            ce = run(x, y)
            valid = y != IGNORE_INDEX
            per = ce.sum(1) / valid.sum(1).clamp(min=1)
            for r, (v, ok) in enumerate(zip(per.tolist(), valid.any(1).tolist())):
                if ok:
                    rows.append((mi, r, float(v)))
    finally:
        pl_module.train(was_training)
        reshard(pl_module)
    return rows


def batch_window_ids(trainer, batch_idx) -> list[list[int]]:
    """This rank's window ids of the epoch's batches `batch_idx`, one per row (-1: padding); [] per batch when the
    data cannot say."""
    dm = getattr(trainer, "datamodule", None)
    return [dm.window_ids(i) if hasattr(dm, "window_ids") else [] for i in batch_idx]


@lru_cache(maxsize=8)
def _tokenizer(shard: str):
    from steadylm.data.shards import read_shard_info
    from steadylm.data.tokenizer import get_tokenizer, load_tokenizer

    try:
        return load_tokenizer(Path(shard).parent)
    except Exception:
        return get_tokenizer(read_shard_info(shard).tokenizer)


def window_text(shard, start: int, end: int) -> str:
    """The decoded text of `tokens[start:end]` in `shard`."""
    from steadylm.data.shards import open_tokens

    ds = open_tokens(shard)
    try:
        ids = ds[int(start) : int(end)].tolist()
    finally:
        ds.file.close()
    return _tokenizer(str(shard)).decode(ids)


def locate_window(trainer, window: int) -> dict:
    """{shard, shard_path, start, end} of a window id in the train split (empty when the data cannot say)."""
    dm = getattr(trainer, "datamodule", None)
    return dm.window_location(window) if hasattr(dm, "window_location") and window >= 0 else {}


def rank_suspects(trainer, step: int, batch_idx: tuple, losses: list[tuple[int, int, float]]) -> list[dict]:
    """One row per window, worst first."""
    ids = batch_window_ids(trainer, batch_idx)
    rows = []
    for mi, r, loss in sorted(losses, key=lambda t: -t[2]):
        window = ids[mi][r] if mi < len(ids) and r < len(ids[mi]) else -1
        where = locate_window(trainer, window)
        preview = ""
        if where:
            try:
                preview = window_text(where["shard_path"], where["start"], where["end"])[:PREVIEW_CHARS]
            except Exception as err:  # a preview is a courtesy; the location is what matters
                preview = f"<unreadable: {type(err).__name__}>"
        rows.append(
            {
                "step": int(step),
                "rank": int(trainer.global_rank),
                "window": window,
                **({"source": where["source"]} if "source" in where else {}),  # data.sources: which one
                "shard": where.get("shard"),
                "start": where.get("start"),
                "end": where.get("end"),
                "loss": round(loss, 4),
                "preview": preview,
            }
        )
    return rows


def spike_suspects(trainer, pl_module, episode: dict, weights=None, weights_step: int | None = None) -> dict:
    """Rank a spike's onset batch's samples by their loss on `weights` (a snapshot; None: the live weights),
    append them to suspects.jsonl and return the evidence for the event (the batch's mean loss, the top rows)."""
    if not episode["batches"]:
        return {}
    if weights is not None and is_sharded(trainer.strategy):
        weights, weights_step = None, None  # a snapshot holds this rank's shards only: use the live weights
    losses = sample_losses(pl_module, episode["batches"], weights)
    rows = rank_suspects(trainer, episode["onset"], episode["batch_idx"], losses)
    for row in rows:
        row["weights_step"] = weights_step
    write_suspects(trainer, rows)
    mean = sum(v for _, _, v in losses) / max(len(losses), 1)
    top = [
        {k: r[k] for k in ("window", "source", "shard", "start", "end", "loss") if k in r} for r in rows[:TOP_SUSPECTS]
    ]
    return {"batch_loss_on_good_weights": mean, "suspects": top}


def spike_cause(trainer, pl_module, episode: dict, to_step: int) -> dict:
    """The evidence and cause of a persisting spike, from its onset batch re-run on the restored step-`to_step`
    weights: still above the bar, the batch is bad; under it, an update broke the weights."""
    evidence = spike_suspects(trainer, pl_module, episode, None, to_step)
    good_loss, bar = evidence.get("batch_loss_on_good_weights"), episode["bar"]
    if good_loss is None:
        return {"cause": "inconclusive", "evidence": "the onset batch was not kept", **evidence}
    where = f"the onset batch's loss on the good step-{to_step} weights is {good_loss:.3f}"
    if good_loss > bar:
        return {"cause": "data", "evidence": f"{where}, above the bar {bar:.3f}: the batch itself is bad", **evidence}
    why = (
        f"{where}, under the bar {bar:.3f}, yet the loss stayed above it for {len(episode['values'])} "
        "steps: an update broke the weights (LR, optimizer state)"
    )
    return {"cause": "update", "evidence": why, **evidence}


def write_suspects(trainer, rows: list[dict]) -> Path:
    path = stability_dir(trainer) / "suspects.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def read_suspects(run_dir) -> list[dict]:
    path = Path(run_dir) / "stability" / "suspects.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a crash
    return out
