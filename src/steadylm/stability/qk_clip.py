"""`QKClip`: bound each attention head's pre-softmax logits by rescaling its W_q / W_k rows (Kimi K2's QK-clip).

Without QK-norm a high LR lets attention logits grow until a head saturates its softmax and the loss stalls
(Wortsman et al. 2023). After an update, each head whose max logit S exceeds `tau` has its logits scaled by exactly
g = max(tau / S, `min_factor`) (a scalar per head commutes with rotary positions; a clipped model exports like any
other). Bounded by `max_clips`; `backoff_after` clipping measurements in a row ask its `Backoff` for a lower LR and a
rewind, since the damage of a too-high LR is done before the logits cross tau. The maxima join the step's collective
(MAX), the clip runs on the device after the update, the accounting in `verdict`. Not under QK-norm (normalised
logits). Under FSDP2 each rank rescales the rows of its own shard of W_q / W_k: nothing is gathered.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from steadylm.errors import ConfigError
from steadylm.stability.backoff import Backoff
from steadylm.stability.check import Check
from steadylm.stability.verdict import OK, Verdict

REWIND_TO = ("growth", "onset", "first")
HISTORY = 4096  # measurements kept for `rewind_to: growth` (a float pair each)
# The evidence of a backoff the owner acts on (`Backoff.ask` and `rewind_target`).
BACKOFF_KEYS = ("lr_backoff", "lr_scale", "backoffs", "max_logit", "onset")
BACKOFF_KEYS += ("rewind_before", "rewind_latest", "rewind_first", "growth_from")


MATERIAL_CLIPS = 10  # clipping steps that make a run `unstable`: a few are the policy doing its job
PERSISTENT_ALARMS = 5  # `attn_logit` alarms (no QK-clip) that make a run `unstable`


def explain(events: list[dict], lr: float | None, cut: str | None) -> str | None:
    """The run's `unstable` line (`stability.instability`) when its attention logits grew past the bar materially:
    any LR backoff, `MATERIAL_CLIPS` clipping steps or `PERSISTENT_ALARMS` `attn_logit` alarms."""
    clips = [e for e in events if e.get("kind") == "qk_clip" and e.get("action") == "clip"]
    backoffs = [e for e in events if e.get("kind") == "lr_backoff"]
    alarms = [e for e in events if e.get("kind") == "attn_logit"]
    if not backoffs and len(clips) < MATERIAL_CLIPS and len(alarms) < PERSISTENT_ALARMS:
        return None
    first = (clips or alarms or backoffs)[0]
    peak = max((float(e["detail"].get("max_logit", e["detail"].get("value", 0.0))) for e in clips + alarms), default=0)
    cause = f"attention logits grew past the bar from step {first['step']} (max {peak:.3g})"
    if clips:
        cause += f"; QK-clip acted on {len(clips)} steps"
    if backoffs:
        scale = float(backoffs[-1]["detail"]["lr_scale"])
        lower = f"optim.lr={lr * scale:.3g}" if lr else f"optim.lr x{scale:g}"
        cause += f", and lowered the LR {len(backoffs)} time(s) to x{scale:g}"
    else:
        lower = f"optim.lr={lr / 3:.3g}" if lr else "a lower optim.lr"
    if not clips and not backoffs:
        cause += f" on {len(alarms)} logging steps, unmitigated"
    cause += f"; {cut}" if cut else ""
    return f"{cause}; fix: model.qk_norm=true, or {lower} (python -m steadylm.doctor runs the LR probe)"


class QKClip(Check):
    name = "qk_clip"

    def __init__(
        self, every_n_steps=1, tau=100.0, min_factor=0.1, max_clips=1000, backoff_after=5, lr_backoff=0.1,
        max_backoffs=2, rewind=True, rewarm_steps=100, rewind_to="growth", growth_floor=0.05,
    ) -> None:  # fmt: skip
        where = "callbacks.stability.qk_clip"
        if every_n_steps < 1:
            raise ConfigError(f"{where}.every_n_steps={every_n_steps} must be >= 1")
        if not tau > 0:
            raise ConfigError(f"{where}.tau={tau} must be > 0 (Kimi K2 uses 100)")
        if not 0 < min_factor <= 1:
            raise ConfigError(f"{where}.min_factor={min_factor} must be in (0, 1]")
        if backoff_after is not None and backoff_after < 1:
            raise ConfigError(f"{where}.backoff_after={backoff_after} must be >= 1, or null to never lower the LR")
        self.every_n_steps, self.backoff_after = int(every_n_steps), backoff_after
        self.tau, self.min_factor, self.max_clips = float(tau), float(min_factor), int(max_clips)
        self.backoff = Backoff(where, lr_backoff, max_backoffs, rewind, rewarm_steps)
        if rewind_to not in REWIND_TO:
            raise ConfigError(f"{where}.rewind_to={rewind_to!r} is not allowed; use one of: {', '.join(REWIND_TO)}")
        if not 0 < growth_floor < 1:
            raise ConfigError(f"{where}.growth_floor={growth_floor} must be in (0, 1): a share of tau")
        self.rewind_to, self.growth_floor = rewind_to, float(growth_floor)
        self.history: deque[tuple[int, float]] = deque(maxlen=HISTORY)  # (step, max logit) of each measurement
        self.clips, self.streak, self.exhausted = 0, 0, False  # steps that clipped; measurements in a row that did
        self.onset = -1  # the step at which the current streak began
        self.attns: list = []  # the attention layers it acts on (`applies`)
        self._armed = -1  # the step whose logits are tracked

    def applies(self, trainer) -> bool:
        net = getattr(trainer.lightning_module, "net", None)
        ok = net is not None and not net.cfg.qk_norm
        self.attns = [b.attn for b in net.blocks] if ok else []
        return bool(self.attns)

    def arm(self, view) -> None:
        if view.step % self.every_n_steps == 0:
            for attn in self.attns:
                attn.track_max_logit = True
            self._armed = view.step

    def measure(self, view) -> dict:
        """This step's per-head max logits (layers x heads), MAX over ranks in the step's collective."""
        if self._armed != view.step:
            return {}
        maxima = []
        for attn in self.attns:
            if attn.head_max_logit is None:  # no forward tracked it (a step with no micro-batch of its own)
                return {}
            maxima.append(attn.head_max_logit.float())
        return {"head_max": ("max", torch.stack(maxima))}

    def after_update(self, view, reduced) -> None:
        """Clip on the device by the reduced maxima (every rank alike): the next step starts from bounded logits."""
        if self._armed < 0:
            return
        self._armed = -1
        for attn in self.attns:
            attn.head_max_logit, attn.track_max_logit = None, False
        head_max = reduced.get(self.name, {}).get("head_max")
        if head_max is not None:  # a healthy head's factor is 1: no host read decides whether to scale
            self.clip(head_max, self.attns)

    def restored(self) -> None:
        """Forget a measurement in flight: logits of abandoned weights never clip the restored ones."""
        self._armed = -1
        for attn in self.attns:
            attn.head_max_logit, attn.track_max_logit = None, False

    def verdict(self, m, view) -> Verdict:
        """The record of `m.step`'s clip from the host's copy of its logits: counts, the streak, a backoff; OK: none."""
        head_max = m.values.get(self.name, {}).get("head_max")
        if head_max is None:
            return OK
        logits = torch.tensor(head_max).float()
        finite = torch.isfinite(logits)
        if finite.any():
            self.history.append((int(m.step), float(logits[finite].max())))
        hit = finite & (logits > self.tau)  # `clip`'s own test, in its precision
        if not bool(hit.any()):  # a healthy step: one read
            self.streak = 0
            return OK
        if self.exhausted:
            return OK
        rows = logits.tolist()
        over = [(layer, head, rows[layer][head]) for layer, head in hit.nonzero().tolist()]
        self.clips += 1
        if self.streak == 0:
            self.onset = m.step
        self.streak += 1
        layer, head, worst = max(over, key=lambda t: t[2])
        factor, clipped = max(self.tau / worst, self.min_factor), [[i, j, round(s, 2)] for i, j, s in over]
        evidence = {"tau": self.tau, "max_logit": worst, "layer": layer, "head": head, "factor": factor}
        evidence.update(heads_clipped=clipped, clips=self.clips, budget=self.max_clips)
        asked = None
        if self.backoff_after is not None and self.streak >= self.backoff_after:
            asked = self.backoff.ask(self.onset)
            if asked is not None:
                self.streak = 0
                evidence.update(asked)
                if "rewind_before" in asked:
                    evidence.update(self.rewind_target())
        if self.clips >= self.max_clips:
            self.exhausted = evidence["exhausted"] = True
        context = {"event_action": "clip"}
        if asked is None:
            return Verdict("log", self.name, evidence, onset=m.step, context=context)
        backoff = {k: evidence[k] for k in BACKOFF_KEYS if k in evidence}
        why = f"QK-clip acted on {self.backoff_after} measurements in a row"
        context.update(backoff=backoff, policy=self.backoff, cause=self.name, why=why)
        return Verdict("backoff", self.name, evidence, onset=m.step, context=context)

    def account(self, step: int, head_max) -> dict | None:
        """`verdict` on the caller's logits (a tensor per layer): the clip's evidence, or None."""
        values = {self.name: {"head_max": torch.stack(list(head_max)).tolist()}}
        return self.verdict(SimpleNamespace(step=step, values=values), None).detail or None

    def step(self, step: int, head_max: list[torch.Tensor], attns: list) -> dict | None:
        """`clip`, then `account` (the host reads the logits now)."""
        self.clip(torch.stack(list(head_max)), attns)
        return self.account(step, head_max)

    def streak_steps(self) -> int:
        """Steps a clipping streak takes to ask for a backoff."""
        return (self.backoff_after or 0) * self.every_n_steps

    @torch.no_grad()
    def clip(self, head_max: torch.Tensor, attns: list) -> None:
        """Rescale, on the device, every head whose max logit (row i of `head_max`: layer i) exceeds tau, others by 1.

        `qkv` rows: H query heads, then n_kv_head key heads (head_dim rows each, bias alike). A key head shared by G
        query heads takes sqrt(min of its group's g) and each query head the rest (sqrt(g) on both when G = 1)."""
        if self.exhausted or not attns:
            return
        D, kv = attns[0].head_dim, attns[0].n_kv_head  # the layers share their head shape: all at once
        s = head_max.float()
        g = torch.where(torch.isfinite(s) & (s > self.tau), self.tau / s, torch.ones_like(s)).clamp(min=self.min_factor)
        k = g.unflatten(-1, (kv, -1)).amin(dim=-1).sqrt()  # each key head: sqrt(min g of its group)
        q = g / k.repeat_interleave(g.shape[-1] // kv, dim=-1)
        rows = torch.cat([q.repeat_interleave(D, dim=-1), k.repeat_interleave(D, dim=-1)], dim=-1)
        for attn, row in zip(attns, rows):
            for p in (attn.qkv.weight, attn.qkv.bias):  # its query and key rows, in place
                if p is None:
                    continue
                scale = row.to(p.device, p.dtype).view(-1, *([1] * (p.dim() - 1)))
                if isinstance(p, DTensor):  # sharded by rows: each rank scales its own rows by its slice of the scale
                    whole = torch.ones(p.shape[0], *scale.shape[1:], device=scale.device, dtype=scale.dtype)
                    whole[: row.numel()] = scale
                    p.mul_(distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None))
                else:
                    p[: row.numel()].mul_(scale)

    def rewind_target(self) -> dict:
        """Where a rewind goes (`rewind_to`): the newest good snapshot at or before `rewind_before`, else the earliest
        up to `rewind_latest` (just before the streak); `rewind_first`: the fit's first snapshot whenever it is held.
        `growth`: back to the last step whose max logit was at most `growth_floor * tau` (`growth_from`); none (a
        trained model's logits start above it): the growth began at the start, so the first or earliest kept (-1)."""
        before, first, growth = self.onset - 1, self.rewind_to == "first", {}
        if self.rewind_to == "growth":
            low = [step for step, peak in self.history if step < self.onset and peak <= self.growth_floor * self.tau]
            before, first = (low[-1], False) if low else (-1, True)
            growth = {"growth_from": low[-1] if low else None}
        return {"rewind_before": before, "rewind_first": first, **growth, "rewind_latest": self.onset - 1}

    def restart(self) -> None:
        """After a backoff (this check's or a precursor signal's) a new streak is needed for the next one."""
        self.streak = 0

    @property
    def lr_scale(self) -> float:  # `benchmarks/lr_sensitivity.py` reads it
        return self.backoff.lr_scale

    def state_dict(self) -> dict:
        state = {"clips": self.clips, "streak": self.streak, "onset": self.onset, "exhausted": self.exhausted}
        return {**state, "history": [list(h) for h in self.history], **self.backoff.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.clips, self.streak, self.onset = int(state["clips"]), int(state["streak"]), int(state["onset"])
        self.exhausted = bool(state["exhausted"])
        self.backoff.load_state_dict(state)
        self.history = deque(((int(a), float(b)) for a, b in state.get("history", [])), maxlen=HISTORY)
