"""A distributed checkpoint's save (sharded_save.py) with real DCP, on a gloo group of one process: a save in flight
or cut short leaves the previous checkpoint whole, and the one `resume=auto` picks; an asynchronous save writes the
values of the moment it was called, whatever training does to them meanwhile."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import load

from steadylm import sharded_save
from steadylm.checkpointing import is_complete, safe_load
from steadylm.resume import latest_checkpoint
from tests.helpers import ROOT


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


def _weights(path) -> float:
    out = {"state_dict": {"w": torch.empty(1000)}}
    load(out, checkpoint_id=path)
    return float(out["state_dict"]["w"][0])


def test_an_async_save_writes_the_state_it_was_given_and_lands_whole(group, tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    last = folder / "last.ckpt"
    w = torch.zeros(1000)
    sharded_save.finish(sharded_save.start({"state_dict": {"w": w}}, {"global_step": 1}, last, 0, dist.barrier), 0)
    assert is_complete(last) and _weights(last) == 0.0

    (folder / ".last.ckpt.tmp").mkdir()  # a killed save's leftovers, cleared by the next
    (folder / ".last.ckpt.tmp" / "junk").write_text("x")
    w.fill_(7.0)
    pending = sharded_save.start({"state_dict": {"w": w}}, {"global_step": 2}, last, 0, dist.barrier, group)
    w.add_(5.0)  # training goes on while the shards are written
    pending.written.result()  # every shard written; killed now, before the swap:
    assert is_complete(last) and _weights(last) == 0.0 and safe_load(last / "meta.pt")["global_step"] == 1
    assert latest_checkpoint(folder) == last  # the old checkpoint, whole, is what a resume finds
    sharded_save.finish(pending, 0)
    assert _weights(last) == 7.0 and safe_load(last / "meta.pt")["global_step"] == 2
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]  # no .tmp or .old left behind


def test_the_save_bench_prints_both_ways_and_their_ratio():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "checkpoint_save_bench.py"), "--quick", "--port", "29561"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    stalls = re.findall(r"^ *(sync|async): stall ([\d.]+) s", proc.stdout, re.M)
    assert [m for m, _ in stalls] == ["sync", "async"] and all(float(s) > 0 for _, s in stalls), proc.stdout
    assert re.search(r"async/sync stall [\d.]+ \(90 % interval [\d.]+-[\d.]+\)", proc.stdout), proc.stdout
