"""A data position counted in batches, recounted for another machine size on resume: a checkpoint's count is turned
into a window position with the shape it was counted in, then into this run's batches, and Lightning's fit-loop
counters follow, so no window is read twice or skipped. Loaded only by a run that resumes (data/sampler.py)."""

from __future__ import annotations

import logging

from steadylm.compat import checkpoint_batches

log = logging.getLogger("steadylm")


def resume_batch(state: dict, global_batch: int, step_batches: int) -> tuple[int, str | None]:
    """The micro-batch of `state`'s epoch a run of this shape (windows per micro-batch, micro-batches per step)
    continues at, and a line when the order cannot be kept. `state` (`batches_done`, and the `global_batch` and
    `step_batches` it was counted in) may come from another number of ranks, batch or accumulation: its count is
    turned into a window position first. The same windows per step: that position exactly, as a checkpoint lies on
    a step boundary. Other: the next whole step of this run from it, said in one line."""
    G, A = int(state.get("global_batch", global_batch)), int(state.get("step_batches", step_batches))
    position, step_windows = int(state["batches_done"]) * G, global_batch * step_batches
    if G * A == step_windows:
        return position // global_batch, None
    start = -(-position // step_windows) * step_batches
    skipped = start * global_batch - position
    line = (
        f"the checkpoint's steps took {G * A} windows ({G} a micro-batch x {A}) and this run's take {step_windows} "
        f"({global_batch} x {step_batches}), so step k no longer trains on the checkpointed run's windows; continuing "
        f"at window {position} of epoch {int(state.get('epoch', 0))}"
        + (f", skipping {skipped} to start a whole step" if skipped else "")
        + ", nothing repeated (set data.global_batch_tokens to keep the order on any number of devices)"
    )
    return start, line


def align_resume(checkpoint: dict, state: dict, global_batch: int, step_batches: int) -> None:
    """Before Lightning restores `checkpoint`: turn its batch counts (the data source's `state`, written in place,
    and the fit loop's) into this run's shape, so no window is read twice or skipped and accumulation and
    validation fall on whole steps on any number of ranks; a resume that cannot keep the order says so."""
    if (counters := checkpoint_batches(checkpoint)) is None:
        return
    start, line = resume_batch(state, global_batch, step_batches)
    if line:
        log.warning("resume: %s", line)
    current, total = (int(counters[part]["processed"]) for part in ("current", "total"))
    earlier = (total - current) // int(state.get("step_batches", step_batches))  # steps of earlier epochs
    for part, value in (("current", start), ("total", earlier * step_batches + start)):
        shift = value - int(counters[part]["processed"])  # every field alike: the restart rules see the same batch
        counters[part] = {k: v + shift if isinstance(v, int) else v for k, v in counters[part].items()}
    state.update(batches_done=start, global_batch=global_batch, step_batches=step_batches)
