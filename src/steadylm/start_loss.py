"""The validation loss of the weights a run starts from (`model.init_from`, `init_from`), logged at step 0 before any
update: the number continued training has to beat. Loaded only by a run from trained weights; a resumed run has it
already (its checkpoint's step is past 0)."""

from __future__ import annotations

import logging

import torch

from steadylm.logging_steps import write_metrics

log = logging.getLogger("steadylm")


@torch.no_grad()
def log_start_loss(module) -> None:
    """Run `module`'s own validation steps over the val loaders (the windows every validation reads) and write
    `val/loss` (and `val/bpb`, per source too) at step 0."""
    trainer = module.trainer
    loaders = getattr(trainer.datamodule, "val_dataloader", lambda: None)()
    if not loaders or not trainer.limit_val_batches:
        return
    module.on_validation_epoch_start()
    module.eval()
    for i, loader in enumerate(loaders if isinstance(loaders, (list, tuple)) else [loaders]):
        for b, batch in enumerate(loader):
            module.validation_step(module.transfer_batch_to_device(batch, module.device, i), b, i)
    module.train()
    results = module.val_results()
    write_metrics(trainer, results, step=0)
    log.info(
        "val/loss %.4f at step 0, before any update: %s's, the loss to beat", results["val/loss"], module.weights_from
    )
