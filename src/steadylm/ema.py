"""`callbacks.ema`: an exponential moving average of the weights for validation and the final weights (modded-nanogpt,
nanochat average the tail), Lightning's own `EMAWeightAveraging` plus the one thing the stability suite needs: a
restore (rollback, rewind, last_good.ckpt) restarts the average from the restored weights, so it never keeps the
abandoned, diverging ones. Validation (`val/loss`, `val/bpb`, `eval/*`), `last.ckpt`'s `state_dict` (what `generate`
and `export` read) and the weights after `fit` are the average; checkpoints keep the trained weights beside it
(`current_model_state`), which resume and the suite's disk rollback train on."""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import EMAWeightAveraging

from steadylm.errors import ConfigError, is_int, number


class EMA(EMAWeightAveraging):
    def __init__(self, decay: float = 0.999, update_starting_at_step: int = 0, **kwargs):
        if not 0 < number(decay) < 1:
            raise ConfigError(
                f"callbacks.ema.decay={decay!r} is not allowed; it must be a number in (0, 1), e.g. 0.999"
            )
        if not (is_int(update_starting_at_step) and update_starting_at_step >= 0):
            raise ConfigError(
                f"callbacks.ema.update_starting_at_step={update_starting_at_step!r} is not allowed; "
                "it must be a whole number of steps >= 0"
            )
        super().__init__(decay=decay, update_starting_at_step=update_starting_at_step, **kwargs)

    @torch.no_grad()
    def weights_restored(self, pl_module) -> None:
        """The suite restored older weights: the average starts again from them (LMModule.continue_from calls it)."""
        if self._average_model is not None:
            for avg, live in zip(self._average_model.module.state_dict().values(), pl_module.state_dict().values()):
                avg.copy_(live)
