"""Every run that has val data validates after its last step, so `result.json` always has `val_loss`.

Lightning validates every `val_check_interval` batches, and on a batch after which the trainer was asked to
stop (`trainer.should_stop`). Asking it to stop once `trainer.max_steps` optimizer steps are done (the loop
would end there anyway) makes the last batch such a batch; when the interval also falls on it, it is still
one validation.
"""

from __future__ import annotations

import lightning as L


class ValidateAtEnd(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= trainer.max_steps > 0:
            trainer.should_stop = True
