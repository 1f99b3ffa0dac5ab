"""Spare Lightning's per-step dispatch to callback hooks that only inherit the base class's no-op.

Lightning calls every callback on every hook, each inside a profiler context, whether or not the callback
implements it: ~20 Python calls per callback and hook, ~460 a step for the hooks the default callbacks only
inherit, over a quarter of what Lightning + the suite added to a raw loop's step on a CPU. Its dispatcher
(`_call_callback_hooks`) skips a hook attribute that is not callable, so an inherited no-op is shadowed by
None on the instance. Only the per-step training hooks, which that dispatcher alone calls; every other hook
is left as it is. Were a future Lightning to drop that check, every fit would fail at its first step with
"'NoneType' object is not callable" (and the test suite with it), never silently.
"""

from __future__ import annotations

from typing import Iterable

import lightning as L

STEP_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
              "on_before_zero_grad", "on_train_batch_end")


def skip_inherited_step_hooks(callbacks: Iterable[L.Callback]) -> None:
    """Set each per-step hook a callback does not implement to None (on the instance, never the class).

    A hook set on the instance (LambdaCallback's) or defined by any class in between is kept.
    """
    for callback in callbacks:
        for name in STEP_HOOKS:
            if getattr(getattr(callback, name, None), "__func__", None) is getattr(L.Callback, name):
                setattr(callback, name, None)
