"""PNG plots for `doctor` and `diagnose`, drawn with matplotlib's file-only Agg backend.

Agg needs no display, so the plots render the same on a headless GPU node, in CI and in a notebook.
Every function writes one PNG and returns its path; none of them reads run files itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_lr_schedule(lrs: Sequence[float], warmup_steps: int, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(range(len(lrs)), lrs)
    if warmup_steps:
        ax.axvline(warmup_steps, color="grey", ls=":", label=f"end of warmup ({warmup_steps})")
        ax.legend()
    ax.set(xlabel="optimizer step", ylabel="learning rate", title="LR schedule")
    return _save(fig, path)
