"""The LightningModule: next-token loss, the optimizer (AdamW, or Muon + AdamW) and the LR of each update."""

from __future__ import annotations

import functools
import logging
import math

import lightning as L
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.distributed.tensor import DTensor

from steadylm.compat import attached_trainer, ends_step, foreach_norm, scale_tensors
from steadylm.distributed import is_sharded, local, reshard
from steadylm.errors import ConfigError
from steadylm.logging_steps import write_metrics
from steadylm.model import GPT, GPTConfig
from steadylm.model.gpt import IGNORE_INDEX, chunked_head_loss, chunked_token_losses
from steadylm.model.mup import param_groups
from steadylm.schedule import Schedule, set_lr

log = logging.getLogger("steadylm")


def check_targets(logits: torch.Tensor, targets: torch.Tensor) -> None:
    """Refuse targets that cross-entropy would accept but mean something else: never cast, a data bug."""
    if targets.dtype != torch.long:
        raise TypeError(
            f"targets must be int64 token ids (torch.long), got {targets.dtype}; "
            "fix the data pipeline instead of casting (a float target is a soft-label bug)"
        )
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} != logits shape {tuple(logits.shape[:-1])}")


class LMModule(L.LightningModule):
    def __init__(
        self,
        model: dict,
        optim: dict,
        compile: bool = False,
        run_config: dict | None = None,
        tokenizer: str | None = None,
        val_bytes_per_token: float | None = None,
        doc_separator: int | None = None,
        val_sources: list[dict] | None = None,
    ):
        super().__init__()
        model, optim = (
            OmegaConf.to_container(c, resolve=True) if isinstance(c, DictConfig) else dict(c) for c in (model, optim)
        )
        self.save_hyperparameters({"model": model, "optim": optim, "compile": compile, "doc_separator": doc_separator})
        self.optim_cfg = optim
        self.z_loss = float(optim.get("z_loss", 0.0))
        self.loss_path, self.loss_chunk = path, chunk = optim.get("loss", "chunked"), optim.get("loss_chunk", 1024)
        if path not in ("chunked", "plain"):
            raise ConfigError(f"optim.loss={path!r} is not allowed; use one of: chunked, plain")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ConfigError(f"optim.loss_chunk={chunk!r} must be a whole number of tokens >= 1 (e.g. 1024)")
        self.net = GPT(GPTConfig(**model))
        self.net.doc_separator = doc_separator  # data.pack=doc (the DataModule's `document_separator`)
        if compile:
            self.net.compile()  # in place: the state_dict keys stay `net.*`, no weight stored twice
        self.run_config = run_config  # saved in every checkpoint: `generate`/`doctor` need nothing else
        self.tokenizer_name = tokenizer
        self.val_bytes_per_token = val_bytes_per_token  # UTF-8 bytes per val token, for val/bpb (None: not known)
        self.val_sources = val_sources  # data.sources: [{name, weight, bytes_per_token}], one per val loader
        # The LR state, written only through `skip_step`, `scale_lr` and `continue_from`. `rewarm`: after a rewind
        # the LR warms up again from the restored step, (applied step it began, its length).
        self.skipped_steps, self.lr_scale, self.rewarm = 0, 1.0, (0, 0)
        self.pre_clip_grad_norm: torch.Tensor | None = None
        self.log_z: torch.Tensor | None = None  # the last training micro-batch's mean log Z (`head_loss`)
        self.token_losses: torch.Tensor | None = None  # its per-position CE, while a check asks (`keep_token_losses`)
        self._keep_token_losses = False
        self.logs_now = False  # the Trainer writes this batch's logs (set in `training_step`)
        self._step_sums: torch.Tensor | None = None  # the step so far, this rank: [loss x valid targets, valid targets]
        self._nominal = 1  # the targets of a step without padding, every micro-batch and rank
        self.weights_from: str | None = None  # `init_from`'s checkpoint: the weights are trained, not an init
        if model.get("init_from") is not None:  # a published model's weights (model/hf.py, loaded only then)
            from steadylm.model.hf import load_pretrained

            self.weights_from = load_pretrained(self.net, model["init_from"])  # a resume loads its own over them

    def setup(self, stage: str) -> None:
        if self.net.doc_separator is not None:  # data.pack=doc: the attention kernel, chosen once for the device
            line = self.net.choose_doc_kernel(self.trainer.strategy.root_device.type)
            if self.trainer.is_global_zero:
                log.info(line)

    def configure_model(self) -> None:
        """FSDP2 (`trainer=fsdp`): each block one `fully_shard` unit, then the root (embeddings, final norm, head), so
        a forward gathers one block's weights at a time; under bf16-mixed they are gathered in bf16 and the gradients
        reduced in fp32. Any other strategy: nothing to do (the hook runs once a fit; a module sharded already stays)."""
        if not is_sharded(self.trainer.strategy) or isinstance(self.net.wte.weight, DTensor):
            return
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        bf16 = self.trainer.precision == "bf16-mixed"
        mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        shard = functools.partial(
            fully_shard, mesh=self.device_mesh["data_parallel"], mp_policy=mixed or MixedPrecisionPolicy()
        )
        for block in self.net.blocks:
            shard(block)
        shard(self.net)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(idx)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean cross-entropy over non-padding targets in fp32, plus z-loss; returns (loss, z_term). A sum / count,
        not a mean: an all-padding batch (the end of an epoch on one rank) gives 0, not NaN."""
        check_targets(logits, targets)
        flat, valid = logits.float().view(-1, logits.shape[-1]), targets.view(-1) != IGNORE_INDEX
        n = valid.sum().clamp(min=1)
        ce = F.cross_entropy(flat, targets.view(-1), ignore_index=IGNORE_INDEX, reduction="sum") / n
        z = flat.new_zeros(())
        if self.z_loss:
            # z-loss (PaLM): keeps log Z near 0 so logits cannot drift to where bf16 softmax loses precision.
            z = self.z_loss * (torch.logsumexp(flat, dim=-1).pow(2) * valid).sum() / n
        return ce + z, z

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`loss(self(x), targets)` by the configured path (`optim.loss`): chunked, the logits of one chunk of
        `optim.loss_chunk` tokens alive at a time, or plain. Same value and gradients; z is detached when chunked.
        Keeps the mean log Z of the micro-batch in `log_z` (a device tensor, never read here: the stats check sends
        it on its steps), which the chunked loss has for free and the plain path pays one log-sum-exp for."""
        if self.loss_path == "plain":
            logits = self(x)
            valid, flat = targets != IGNORE_INDEX, logits.detach().float()
            self.log_z = (torch.logsumexp(flat, dim=-1) * valid).sum() / valid.sum().clamp(min=1)
            if self._keep_token_losses:
                ce = F.cross_entropy(flat.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
                self.token_losses = ce.view(targets.shape)
            return self.loss(logits, targets)
        hidden = self.net(x, head=False)
        check_targets(hidden, targets)
        cap, keep = self.net.cfg.logit_softcap, self._keep_token_losses
        out = chunked_head_loss(hidden, self.net.lm_head.weight, targets, self.z_loss, self.loss_chunk, cap, keep)
        self.log_z, self.token_losses = out.log_z, out.token_losses
        return out.loss, out.z

    def keep_token_losses(self, on: bool) -> None:
        """Keep each training position's CE in `token_losses` (a check asks for it; one float a token)."""
        self._keep_token_losses = bool(on)

    def target_losses(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-target cross-entropy (fp32, 0 at padding), shaped like `targets`, without gradients (`optim.loss=plain`:
        one chunk of every token). For the exact val loss, the suspects' per-sample losses and multiple-choice scoring."""
        with torch.no_grad():
            hidden = self.net(x, head=False)
            check_targets(hidden, targets)
            chunk = max(1, targets.numel()) if self.loss_path == "plain" else self.loss_chunk
            return chunked_token_losses(hidden, self.net.lm_head.weight, targets, chunk, self.net.cfg.logit_softcap)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The micro-batch's summed loss over the targets a micro-batch holds unpadded: every token of the step weighs
        the same, however the padding (`data.align=doc`, an epoch's last windows) falls on micro-batches and ranks.
        `on_after_backward` makes the step's gradient the mean over its valid targets (no padding: a factor of 1)."""
        x, y = batch
        loss, z = self.head_loss(x, y)
        valid = (y != IGNORE_INDEX).sum()
        t, sums = self.trainer, torch.stack([loss.detach().double() * valid, valid.double()])
        self._step_sums = sums if self._step_sums is None else self._step_sums + sums
        self._nominal = y.numel() * t.accumulate_grad_batches * t.world_size  # the step's targets, all ranks
        # Only on the steps the Trainer writes (`self.log` costs milliseconds), as a host copy (Lightning reads the
        # progress-bar value every step: on a device tensor, one more host sync). The step's hooks reuse it.
        self.logs_now = (t.global_step + 1) % t.log_every_n_steps == 0 or t.should_stop
        if self.logs_now and self.z_loss:
            self.log("train/z_loss", z, on_step=True)
        return loss * (valid / y.numel())

    def on_after_backward(self) -> None:
        """At the step's last micro-batch: its valid targets over every micro-batch and rank (one all-reduce of two
        numbers, read by no host but on a logging step) scale the gradients to their mean over those targets
        (torchtitan #1842); `train/loss` is the step's token mean."""
        t = self.trainer
        if not ends_step(t):
            return
        sums, self._step_sums = self._step_sums, None
        if t.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(sums)
        count = sums[1].clamp(min=1)
        grads = [local(p.grad) for p in self.parameters() if p.grad is not None]
        if grads:
            scale_tensors(grads, (self._nominal / count).float())
        if self.logs_now:
            self.log("train/loss", (sums[0] / count).float().cpu(), on_step=True, prog_bar=True)

    def on_validation_epoch_start(self) -> None:
        # [loader, (summed CE, target count)]: one row, or one per source's val loader
        rows = len(self.val_sources) if self.val_sources else 1
        self._val_totals = torch.zeros(rows, 2, dtype=torch.float64, device=self.device)

    def validation_step(self, batch, batch_idx, dataloader_idx: int = 0) -> None:
        x, y = batch
        sums = torch.stack([self.target_losses(x, y).double().sum(), (y != IGNORE_INDEX).sum().double()])
        self._val_totals[dataloader_idx] += sums

    def val_results(self) -> dict[str, float]:
        """`val/loss`: sums across ranks, then one division, so every non-padding target weighs the same; `val/bpb`:
        bits per UTF-8 byte of the val split, so runs with different tokenizers compare. With `data.sources`, the
        same per source (`val/loss/<name>`, `val/bpb/<name>`), and `val/loss`, `val/bpb` their weighted means."""
        reshard(self)  # FSDP: the gathered root weights of the last val forward are not kept for training
        totals = self.trainer.strategy.reduce(self._val_totals, reduce_op="sum").tolist()
        losses = [ce_sum / max(count, 1.0) for ce_sum, count in totals]
        bits = lambda loss, per_token: loss / math.log(2) / per_token  # noqa: E731
        if not self.val_sources:
            out = {"val/loss": losses[0]}
            return out | ({"val/bpb": bits(losses[0], self.val_bytes_per_token)} if self.val_bytes_per_token else {})
        out, bpb = {}, {}
        for source, loss in zip(self.val_sources, losses):
            out[f"val/loss/{source['name']}"] = loss
            if source["bytes_per_token"]:
                out[f"val/bpb/{source['name']}"] = bpb[source["name"]] = bits(loss, source["bytes_per_token"])
        weights = [s["weight"] for s in self.val_sources]
        out["val/loss"] = sum(w * v for w, v in zip(weights, losses))
        if len(bpb) == len(losses):
            out["val/bpb"] = sum(w * v for w, v in zip(weights, bpb.values()))
        return out

    def on_validation_epoch_end(self) -> None:
        for key, value in self.val_results().items():
            self.log(key, value, prog_bar=key == "val/loss", sync_dist=False)

    def on_train_start(self) -> None:
        if self.weights_from is not None and not self.trainer.global_step:  # trained weights: their loss, to beat
            from steadylm.start_loss import log_start_loss  # loaded only by a run that starts from them

            log_start_loss(self)

    def on_before_optimizer_step(self, optimizer) -> None:
        """The LR of this update, after every callback judged the step: `Schedule.lr_of` the applied steps (at least
        0: a step under a restore counts -1) and the LR scale. The last step asks the Trainer to stop, so Lightning
        validates after it: every run with val data ends with a `val/loss`."""
        trainer = self.trainer
        lr = self.schedule.lr_of(max(0, trainer.global_step - self.skipped_steps), self.lr_scale, self.rewarm)
        set_lr(optimizer, lr)
        if self.logs_now:
            write_metrics(trainer, {"optim/lr": lr})
        if trainer.global_step + 1 >= trainer.max_steps > 0:
            trainer.should_stop = True

    @functools.cached_property
    def schedule(self) -> Schedule:
        """Built on first use: a module built for its loss alone needs no schedule keys."""
        return Schedule.from_optim(self.optim_cfg)

    def applied_steps(self, step: int | None = None) -> int:
        """Updates in the weights at optimizer step `step` (default: now): the steps the LR schedule has taken."""
        return (self.trainer.global_step if step is None else step) - self.skipped_steps

    def skip_step(self) -> None:
        """The update under way does not count: the LR does not advance on it."""
        self.skipped_steps += 1

    def scale_lr(self, factor: float) -> float:
        """Every later update's LR times `factor` (an LR backoff); returns the new scale."""
        self.lr_scale *= float(factor)
        return self.lr_scale

    def continue_from(self, applied: int, step: int, rewarm_steps: int = 0) -> None:
        """Weights restored from a state `applied` updates in, at optimizer step `step`: the schedule resumes where
        those weights left off, warming up again over `rewarm_steps` from there (0: at once)."""
        self.skipped_steps = step - applied
        if rewarm_steps:
            self.rewarm = (applied, rewarm_steps)

    def grad_norms(self) -> tuple[torch.Tensor | None, list[torch.nn.Parameter]]:
        """(the L2 norm of each parameter's gradient, those parameters), in the optimizer's order; the total is
        kept for this step's clipping, so the gradients are walked once. Sharded (FSDP2): the norms of this rank's
        slices, and no total (the step's all-reduce makes it: `set_sharded_grad_norm`)."""
        params = [p for opt in self.trainer.optimizers for group in opt.param_groups for p in group["params"]]
        with_grad = [p for p in params or self.parameters() if p.grad is not None]
        norms = torch.stack(foreach_norm([local(p.grad) for p in with_grad])).float() if with_grad else None
        whole = norms is not None and not is_sharded(self.trainer.strategy)
        self.pre_clip_grad_norm = torch.linalg.vector_norm(norms) if whole else None
        return norms, with_grad

    def set_sharded_grad_norm(self, norm: torch.Tensor) -> None:
        """The global pre-clip norm of sharded gradients (the step's all-reduce of the slices' squares), for clipping."""
        self.pre_clip_grad_norm = norm

    def configure_optimizers(self) -> torch.optim.Optimizer:
        o, trainer = self.optim_cfg, attached_trainer(self)  # None in a plain loop
        # `optim.fused`: auto = fused wherever torch has the kernel (~5x faster, on CPU too), except under fp16,
        # whose GradScaler must unscale before clipping.
        fp16 = trainer is not None and trainer.precision == "16-mixed"
        fused = o.get("fused", "auto")
        fused = self.device.type in ("cuda", "cpu") and not fp16 if fused == "auto" else bool(fused)
        common = {"lr": o["lr"], "betas": tuple(o["betas"]), "eps": o["eps"], "fused": fused}
        if o.get("name", "adamw") != "muon":
            # Weight decay on matrices only; each group's `lr_mult` is muP's LR factor (1 under sp).
            groups = param_groups(self.named_parameters(), self.net.cfg, lr=o["lr"], weight_decay=o["weight_decay"])
            return torch.optim.AdamW(groups, **common)
        # Muon on the blocks' matrices, AdamW on the rest (loaded only by a run that picks it).
        from steadylm.muon import Muon
        from steadylm.muon import param_groups as muon_groups

        knobs = ("momentum", "nesterov", "ns_steps", "ns_dtype", "ns_coeffs", "adjust_lr")
        return Muon(muon_groups(self.net, o), **common, **{k: o["muon"][k] for k in knobs})

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip here, not through the precision plugin (it refuses any clipping next to a fused optimizer, even under
        bf16); fp16's gradients are unscaled already. The pre-clip norm is the suite's measurement when taken."""
        norm, self.pre_clip_grad_norm = self.pre_clip_grad_norm, None
        if not gradient_clip_val:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]  # torch skips those without a grad
        if gradient_clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
            return
        if norm is None:  # sharded gradients (DTensors): the norm of their slices is a partial sum, made whole here
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, norm)
        if self.logs_now:  # the one writer of optim/grad_norm whenever the module clips by norm
            write_metrics(self.trainer, {"optim/grad_norm": float(norm)})

    @staticmethod
    def clips_by_norm(trainer: L.Trainer) -> bool:
        """The module clips by norm (and so logs `optim/grad_norm`)."""
        return bool(trainer.gradient_clip_val) and trainer.gradient_clip_algorithm == "norm"

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["steadylm"] = {
            "config": self.run_config,
            "tokenizer": self.tokenizer_name,
            "skipped_steps": self.skipped_steps,
            "lr_scale": self.lr_scale,
            "rewarm": list(self.rewarm),
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # The first restore hook: the data recounts the checkpoint's batch counts for this machine (data/position.py).
        trainer = attached_trainer(self)
        if (align := getattr(getattr(trainer, "datamodule", None), "align_resume", None)) is not None:
            align(checkpoint)
        meta = checkpoint.get("steadylm", {})
        self.skipped_steps = int(meta.get("skipped_steps", 0))
        self.lr_scale = float(meta.get("lr_scale", 1.0))
        self.rewarm = tuple(int(v) for v in meta.get("rewarm", (0, 0)))
