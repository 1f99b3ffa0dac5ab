"""`DownstreamEval`: multiple-choice accuracy (`eval/<task>/acc`, `eval/<task>/acc_norm`) on every `every`-th
validation (sanity checks excluded); off while `tasks` is empty. Each task's first `limit` items are split over the
ranks (item i on rank i % world), scored through `LMModule.target_losses` under the run's precision; the counts
[acc, acc_norm, items] are summed in one all-reduce. Under FSDP2 the scoring forwards gather the weights as
training's do (the same scores as under DDP: tests/test_fsdp.py)."""

from __future__ import annotations

import lightning as L
import torch

from steadylm.errors import ConfigError


class DownstreamEval(L.Callback):
    def __init__(self, tasks: list[str] | None = None, limit: int | None = 500, every: int = 1, batch_size: int = 16):
        if limit is not None and (isinstance(limit, bool) or int(limit) < 1):
            raise ConfigError(f"callbacks.eval.limit={limit!r} must be a number of items >= 1, or null (all)")
        if int(every) < 1 or int(batch_size) < 1:
            raise ConfigError("callbacks.eval.every and callbacks.eval.batch_size must be >= 1")
        self.specs, self.limit, self.every, self.batch_size = list(tasks or []), limit, int(every), int(batch_size)
        self.runs = 0  # validations seen (not counting the sanity check)
        self._work: list[tuple[str, list, list]] | None = None  # (task, this rank's items, their requests)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self.specs or self._work is not None:
            return
        from steadylm.data.tokenizer import tokenizer_of_run  # loaded only when a run names tasks
        from steadylm.eval.score import requests
        from steadylm.eval.tasks import load_task

        tok = tokenizer_of_run({"tokenizer": pl_module.tokenizer_name, "config": pl_module.run_config})
        self._work = []
        for spec in self.specs:
            task = load_task(spec, self.limit)  # every rank reads the same file: the same items in the same order
            mine = list(task.items[trainer.global_rank :: trainer.world_size])
            self._work.append((task.name, mine, requests(tok, mine, pl_module.net.cfg.context_length)))

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._work or trainer.sanity_checking:
            return
        self.runs += 1
        if (self.runs - 1) % self.every:
            return
        from steadylm.eval.score import correct, loglikelihoods

        counts = []
        with trainer.precision_plugin.forward_context():
            for _, items, reqs in self._work:
                lls = loglikelihoods(pl_module.target_losses, reqs, self.batch_size, pl_module.device)
                counts.append([*correct(items, lls), len(items)])
        totals = torch.tensor(counts, dtype=torch.float64, device=pl_module.device)
        totals = trainer.strategy.reduce(totals, reduce_op="sum").tolist()
        for (name, _, _), (acc, acc_norm, n) in zip(self._work, totals):
            pl_module.log(f"eval/{name}/acc", acc / max(n, 1.0), sync_dist=False)
            pl_module.log(f"eval/{name}/acc_norm", acc_norm / max(n, 1.0), sync_dist=False)

    def state_dict(self) -> dict:
        return {"runs": self.runs}

    def load_state_dict(self, state_dict: dict) -> None:
        self.runs = int(state_dict.get("runs", 0))
