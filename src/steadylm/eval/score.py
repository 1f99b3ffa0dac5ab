"""Multiple-choice scoring the way lm-eval does it: each choice's summed log-likelihood as a continuation.

For every item and choice: the continuation is `" " + choice` (lm-eval's default target delimiter), trailing
spaces of the context move into it, and its tokens are those of `context + continuation` past the context's own
tokens (so a merge across the boundary is scored as lm-eval scores it). The sequence keeps its last
`context_length + 1` tokens. `acc`: the choice of highest summed log-likelihood is the label; `acc_norm`: the
same after dividing each by its choice's length in characters (`len(choice)`, lm-eval's `acc_norm`). The model
is any `target_losses(x, y)` (per-target cross-entropy, 0 at -100): the module's chunked head, no whole logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from steadylm.eval.tasks import Item
from steadylm.model.gpt import IGNORE_INDEX

TargetLosses = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids), lm-eval's split; an empty context is the end-of-text token."""
    if not context:
        return [tok.eos_id], tok.encode(continuation)
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return ctx, whole[len(ctx) :]


def requests(tok, items: Sequence[Item], context_length: int) -> list[tuple[list[int], int]]:
    """One (token ids, number of continuation tokens at the end) per item and choice, cut to the context."""
    out = []
    for item in items:
        for choice in item.choices:
            ctx, cont = encode_pair(tok, item.context, " " + choice)
            ids = (ctx + cont)[-(context_length + 1) :]
            out.append((ids, min(len(cont), len(ids) - 1)))
    return out


@torch.no_grad()
def loglikelihoods(
    target_losses: TargetLosses, reqs: list[tuple[list[int], int]], batch_size: int, device
) -> list[float]:
    """Summed log-likelihood of each request's continuation, `batch_size` sequences (right-padded) per forward."""
    out = []
    for s in range(0, len(reqs), batch_size):
        chunk = reqs[s : s + batch_size]
        width = max(len(ids) for ids, _ in chunk) - 1
        x = torch.zeros(len(chunk), width, dtype=torch.long)
        y = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)
        for r, (ids, n_cont) in enumerate(chunk):
            t = torch.tensor(ids)
            x[r, : len(ids) - 1] = t[:-1]
            y[r, len(ids) - 1 - n_cont : len(ids) - 1] = t[len(ids) - n_cont :]
        out.extend((-target_losses(x.to(device), y.to(device)).double().sum(1)).tolist())
    return out


def correct(items: Sequence[Item], lls: Sequence[float]) -> tuple[int, int]:
    """(items right by acc, by acc_norm), given every choice's log-likelihood in `requests`' order."""
    acc = acc_norm = 0
    k = 0
    for item in items:
        ll = lls[k : k + len(item.choices)]
        k += len(item.choices)
        norm = [v / max(len(c), 1) for v, c in zip(ll, item.choices)]
        acc += max(range(len(ll)), key=ll.__getitem__) == item.label
        acc_norm += max(range(len(norm)), key=norm.__getitem__) == item.label
    return acc, acc_norm


def score(
    target_losses: TargetLosses, tok, items: Sequence[Item], context_length: int, batch_size: int = 16, device="cpu"
) -> tuple[int, int]:
    """(acc count, acc_norm count) of `items`."""
    return correct(items, loglikelihoods(target_losses, requests(tok, items, context_length), batch_size, device))
