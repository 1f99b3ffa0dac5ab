"""One quiet optimizer step stays small: the project functions it calls, counted by a profiler on a real fit.

Quiet: no logging, stats, snapshot, validation or checkpoint falls on it (the default callbacks otherwise, the
console lines' and QK-clip's every-step hooks included), and past the spike detector's warmup, so its statistic
runs. Counted from `on_train_batch_start` of step 35 to that of step 36, so the data loading of step 36 is inside.
The bounds are today's figures, so the step does not grow unnoticed (the issue's goal: 40 functions in 12 files;
nanoGPT's step is about 5 in 2, torchtitan's about 8 in 5).
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L

from tests.helpers import fit

SRC = str(Path(__file__).resolve().parents[1] / "src" / "steadylm")
MAX_FUNCTIONS, MAX_FILES = 35, 12


class CountCalls(L.Callback):
    """The distinct project functions (file, name) called between the starts of two optimizer steps."""

    def __init__(self, step: int) -> None:
        self.step, self.seen, self._on = step, set(), False

    def _profile(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(SRC):
            self.seen.add((frame.f_code.co_filename[len(SRC) + 1 :], frame.f_code.co_name))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and not self._on:
            self._on = True
            sys.setprofile(self._profile)
        elif trainer.global_step == self.step + 1 and self._on:
            sys.setprofile(None)
            self._on = False


def quiet_step_calls(make_cfg, *overrides: str) -> set[tuple[str, str]]:
    counter = CountCalls(step=35)  # stats at 29 and 39, snapshots at 25 and 50, validation at 30
    cfg = make_cfg(
        "trainer.max_steps=37",
        "trainer.log_every_n_steps=50",
        "trainer.val_check_interval=10",
        "callbacks.checkpoint.every_n_train_steps=50",
        "callbacks.stability.recovery.every_n_steps=25",
        "trainer.enable_progress_bar=true",  # as a user's run: the console lines' callback is counted too
        *overrides,
    )
    fit(cfg, counter)
    return counter.seen


def test_a_quiet_step_calls_few_project_functions(make_cfg):
    seen = quiet_step_calls(make_cfg)
    files = sorted({f for f, _ in seen})
    listing = "\n".join(f"{f}:{n}" for f, n in sorted(seen))
    assert seen, "the profiler saw no project function: the counter is broken"
    assert len(seen) <= MAX_FUNCTIONS, f"{len(seen)} functions in {len(files)} files:\n{listing}"
    assert len(files) <= MAX_FILES, f"{len(files)} files: {files}"
