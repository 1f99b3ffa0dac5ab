"""A mixture's resume under other `data.sources`: the checkpoint records the mixture it read (each source's name,
size, share of the table and draws so far, data/mixture.py `state_at`). The same mixture continues exactly. Other
weights, or sources added or dropped, are taken as meant (an annealing phase changes the weights on purpose): the
stream is anchored at the checkpoint's position, the new shares apply from its step and each source goes on from its
own draws so far, so none repeats or skips a window; one line says so. A source whose size changed cannot go on in
its order (windows would repeat or be skipped unseen): refused, naming its `dir`. Loaded only by a resume.
"""

from __future__ import annotations

import logging

import numpy as np

from steadylm.errors import ConfigError

log = logging.getLogger("steadylm")


def continue_mixture(sampler, record: dict | None) -> None:
    """Set `sampler.order`'s anchor from the checkpoint's `record` (None: a checkpoint without one), after the base
    class loaded the position; say what changed, or refuse a source whose size did."""
    order, here = sampler.order, sampler.epoch * sampler.n_windows + sampler.start_batch * sampler.global_batch
    say = log.info if sampler.rank == 0 else (lambda *args: None)
    if record is None:
        say(
            "resume: the checkpoint records no data.sources (a run on one data.dir, or an older steadylm); the "
            "mixture goes on at its position %d as if it had been read from step 0",
            here,
        )
        return
    names, sizes, quota = list(record["names"]), list(record["sizes"]), list(record["quota"])
    if (names, sizes, quota) == (order.names, order.sizes.tolist(), order.quota.tolist()):
        if (anchor := record.get("anchor")) is not None:  # a mixture changed by an earlier resume: the same anchor
            order.anchor = (int(anchor[0]) * sampler.n_windows + int(anchor[1]), np.asarray(anchor[2], dtype=np.int64))
        return
    old = {n: (size, q, d) for n, size, q, d in zip(names, sizes, quota, record["drawn"])}
    for name, size, q in zip(order.names, order.sizes.tolist(), order.quota.tolist()):
        if name in old and old[name][0] != size and q:
            raise ConfigError(
                f"data.sources.{name}.dir holds {size:,} train windows, and the checkpoint's {name} held "
                f"{old[name][0]:,}: its order cannot go on (windows would repeat or be skipped); point "
                f"data.sources.{name}.dir at the data it trained on, or give the source a new name to start its order"
            )
    order.anchor = (here, np.asarray([old[n][2] if n in old else 0 for n in order.names], dtype=np.int64))
    T = len(order.table)  # a share: the positions of the table a source holds
    changes = [
        f"{n} {old[n][1] / T:.1%} -> {q / T:.1%}" if n in old else f"{n} new at {q / T:.1%}"
        for n, q in zip(order.names, order.quota.tolist())
        if n not in old or old[n][1] != q
    ]
    changes += [f"{n} dropped" for n in names if n not in order.names] or ([] if changes else ["their order"])
    step = record.get("step")
    say(
        "resume: data.sources differ from the checkpoint's (%s): the new shares apply from %s, each source going on "
        "with the next window of its own order that it has not read (nothing repeated or skipped); the checkpoint's "
        "data.sources keep the old stream",
        ", ".join(changes),
        f"step {step}" if step is not None else f"stream position {here}",
    )
