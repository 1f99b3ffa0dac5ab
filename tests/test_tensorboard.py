"""The metric names users see in TensorBoard: a real server on 127.0.0.1, read over its HTTP API."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from steadylm.train import train

TENSORBOARD = Path(sys.executable).with_name("tensorboard")
EXPECTED = {"train/loss", "val/loss", "optim/lr", "optim/grad_norm", "optim/skipped_steps", "perf/tokens_per_sec"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scalar_tags(port: int, timeout: float = 60.0) -> set[str]:
    """Poll until the server has loaded the run's scalars (it indexes event files in the background)."""
    deadline = time.monotonic() + timeout
    tags: set[str] = set()
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=5) as r:
                runs = json.load(r)
            tags = {tag for run_tags in runs.values() for tag in run_tags}
            if EXPECTED <= tags:
                return tags
        except OSError:
            pass  # not listening yet
        time.sleep(0.5)
    return tags


def test_tensorboard_server_serves_the_contract_tags(make_cfg, tmp_path):
    train(
        make_cfg(
            "trainer.max_steps=4",
            "optim.warmup_steps=2",
            "trainer.val_check_interval=4",
            "data.val_windows=8",
            "trainer.log_every_n_steps=1",
        )
    )
    port = free_port()
    server = subprocess.Popen(
        [
            str(TENSORBOARD),
            "--logdir",
            str(tmp_path / "run"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--reload_interval",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        tags = scalar_tags(port)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert EXPECTED <= tags, f"missing {EXPECTED - tags}; served {sorted(tags)}"
    assert {"stability/update_ratio", "stability/grad_norm/block_0", "stability/max_attn_logit/block_1"} <= tags
