"""Each private Lightning/torch attribute steadylm borrows, exercised against the installed versions.

When an upgrade moves one, the failing test names it; `compat.py` is the one file to mend.
"""

import ast
import platform
import re
from pathlib import Path

import lightning as L
import pytest
import torch

from steadylm import compat
from steadylm.train import build

SRC = Path(__file__).resolve().parents[1] / "src" / "steadylm"


def test_cpu_has_bf16_follows_the_cpu_flags_torch_needs():
    """torch's bf16 CPU path needs AVX-512 BW, VL and DQ (its own error message says so); the answer follows them."""
    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() != "x86_64" or not cpuinfo.is_file():
        pytest.skip("reads the x86 flags from /proc/cpuinfo")
    flags = set(re.search(r"^flags\s*:(.*)$", cpuinfo.read_text(), re.M).group(1).split())
    assert compat.cpu_has_bf16() is ({"avx512bw", "avx512vl", "avx512dq"} <= flags)


def test_per_tensor_norms_match_the_public_norm():
    tensors = [torch.randn(3, 4), torch.randn(5)]
    assert torch.allclose(compat.per_tensor_norms(tensors), torch.stack([t.norm() for t in tensors]))


def test_found_inf_makes_fused_adamw_skip_its_step_on_the_device():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    p.grad = torch.ones(3)
    compat.set_found_inf(opt, torch.ones(()))
    opt.step()
    assert torch.equal(p.detach(), torch.ones(3)) and opt.state[p]["step"].item() == 0  # weights and count untouched
    compat.set_found_inf(opt, torch.zeros(()))
    opt.step()
    assert not torch.equal(p.detach(), torch.ones(3)) and opt.state[p]["step"].item() == 1
    compat.clear_found_inf(opt)
    assert not hasattr(opt, "found_inf")


def test_set_loss_scale_before_and_after_the_first_step():
    scaler = torch.amp.GradScaler("cpu")
    compat.set_loss_scale(scaler, 2.0**10)
    assert scaler.get_scale() == 2.0**10  # before the first step: the initial scale
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(p.sum()).backward()
    scaler.step(opt)
    scaler.update()
    compat.set_loss_scale(scaler, 4.0)
    assert scaler.get_scale() == 4.0


def test_checkpoint_period():
    cb = L.pytorch.callbacks.ModelCheckpoint(every_n_train_steps=7)
    assert compat.every_n_train_steps(cb) == 7
    assert compat.every_n_train_steps(L.pytorch.callbacks.ModelCheckpoint()) == 0


def test_the_sharded_strategy_s_timeout_and_checkpoint_form():
    from datetime import timedelta

    from steadylm.distributed import FSDP2Strategy

    strategy = FSDP2Strategy(timeout=timedelta(seconds=42))
    assert compat.pg_timeout(strategy) == timedelta(seconds=42) and compat.saves_sharded(strategy)
    assert not compat.saves_sharded(FSDP2Strategy(save_distributed_checkpoint=False))


def test_trainer_internals_during_a_fit(make_cfg):
    """logged_step, batches_processed and attached_trainer read inside a real fit, and the module's own
    reckoning of Lightning's logging steps (`logs_now`)."""
    seen = []

    class Spy(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(
                (
                    pl_module.logs_now,
                    compat.logged_step(trainer),
                    compat.batches_processed(trainer),
                    compat.attached_trainer(pl_module) is trainer,
                )
            )

    objects = build(
        make_cfg(
            "trainer.max_steps=4",
            "trainer.log_every_n_steps=2",
            "optim.warmup_steps=1",
            "trainer.limit_val_batches=0",
            "callbacks=minimal",
        )
    )
    assert compat.attached_trainer(objects["module"]) is None
    objects["trainer"].callbacks.append(Spy())
    objects["trainer"].fit(objects["module"], datamodule=objects["datamodule"])
    assert [s[0] for s in seen] == [False, True, False, True]
    assert [s[2] for s in seen] == [1, 2, 3, 4]
    assert [s[1] for s in seen] == [0, 1, 2, 3] and all(s[3] for s in seen)


def test_checkpoint_batch_counters_read_and_move(make_cfg, tmp_path):
    """A real checkpoint's fit-loop counters: found where Lightning wrote them, rewritten, restored by Lightning."""
    objects = build(
        make_cfg("trainer.max_steps=3", "optim.warmup_steps=1", "trainer.limit_val_batches=0", "callbacks=minimal")
    )
    objects["trainer"].fit(objects["module"], datamodule=objects["datamodule"])
    objects["trainer"].save_checkpoint(tmp_path / "a.ckpt")
    ckpt = torch.load(tmp_path / "a.ckpt", weights_only=False)
    counters = compat.checkpoint_batches(ckpt)
    assert (counters["current"]["processed"], counters["total"]["processed"]) == (3, 3)
    counters["current"]["processed"], counters["total"]["processed"] = 6, 10
    trainer = L.Trainer(accelerator="cpu", logger=False)
    trainer.fit_loop.load_state_dict(ckpt["loops"]["fit_loop"])
    progress = trainer.fit_loop.epoch_loop.batch_progress
    assert (progress.current.processed, progress.total.processed) == (6, 10)
    assert compat.checkpoint_batches({"loops": {}}) is None


def own_private_names() -> set[str]:
    """`_names` steadylm defines itself (methods, functions, attributes it assigns): using them is not borrowing."""
    names = set()
    for path in SRC.rglob("*.py"):
        if path.name == "compat.py":  # it assigns borrowed attributes (`_last_lr`); those stay borrowed
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if n.startswith("_")}


OWN = own_private_names()
# Attributes without an underscore that are still another library's undocumented protocol: the optimizers read
# `found_inf`/`grad_scale` that GradScaler sets on them.
PROTOCOL = {"found_inf", "grad_scale"}


def private_uses(tree: ast.AST) -> list[str]:
    """`x._name` that steadylm does not define itself (a library's private attribute), `from lib import _name`, or
    an undocumented protocol attribute (`found_inf`, `grad_scale`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in PROTOCOL:
            found.append(f"line {node.lineno}: .{node.attr}")
        if isinstance(node, ast.Constant) and node.value in PROTOCOL:
            found.append(f"line {node.lineno}: {node.value!r}")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if node.attr not in OWN:
                found.append(f"line {node.lineno}: .{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "lightning"):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.startswith("_")]
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and any(part.startswith("_") and not part.startswith("__") for part in node.module.split("."))
        ):
            found.append(f"line {node.lineno}: from {node.module}")
    return found


@pytest.mark.parametrize("path", sorted(p for p in SRC.rglob("*.py") if p.name != "compat.py"), ids=lambda p: p.name)
def test_no_private_library_attribute_outside_compat(path):
    found = private_uses(ast.parse(path.read_text()))
    assert not found, f"{path.relative_to(SRC)} reaches private attributes outside compat.py: {found}"


def test_the_scan_sees_what_it_must_and_passes_our_own_names():
    """Each kind of borrowing the scan exists for, in a snippet; and a private name steadylm defines passes."""
    snippet = (
        "opt.found_inf = flag\nopt.__dict__.pop('grad_scale', None)\ntrainer._logger_connector.reset()\n"
        "from torch._dynamo import config\nfrom lightning.pytorch.utilities import _get_node\nself._val_totals = 0\n"
    )
    found = sorted(private_uses(ast.parse(snippet)))
    assert found == [
        "line 1: .found_inf",
        "line 2: 'grad_scale'",
        "line 3: ._logger_connector",
        "line 4: from torch._dynamo",
        "line 5: import _get_node",
    ], found
