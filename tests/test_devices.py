"""`steadylm.devices`: how many processes, on what, answered once and the way Lightning answers it."""

from __future__ import annotations

import types

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from steadylm.config import compose
from steadylm.devices import Devices, devices_of, parse_devices, resolve
from steadylm.doctor.check import FAIL, OK
from steadylm.doctor.data_checks import check_datamodule
from steadylm.errors import ConfigError
from steadylm.memory import ADAMW_BYTES_PER_PARAM, plan


def trainer(accelerator="auto", devices="auto", num_nodes=1):
    return OmegaConf.create({"accelerator": accelerator, "devices": devices, "num_nodes": num_nodes})


@pytest.mark.parametrize(
    "value,parsed",
    [("auto", "auto"), (-1, -1), ("-1", -1), (3, 3), ("3", 3), ([0, 2], [0, 2]), ("0,1", [0, 1]), (" 1, 2 ", [1, 2])],
)
def test_parse_devices(value, parsed):
    assert parse_devices(value) == parsed


@pytest.mark.parametrize("value", [0, "0", -2, 1.5, True, "abc", "", [], [0, 0], [-1], [True], "0,x", None])
def test_parse_devices_refuses(value):
    assert parse_devices(value) is None


# (accelerator, devices, visible CUDA GPUs, MPS) -> (accelerator, processes per node)
TABLE = [
    ("cpu", "auto", 0, False, ("cpu", 1)),
    ("auto", "auto", 0, False, ("cpu", 1)),  # Lightning: auto on a CPU machine is one process
    ("cpu", "auto", 8, False, ("cpu", 1)),  # the CPU chosen on a GPU machine
    ("cpu", 4, 8, False, ("cpu", 4)),
    ("cpu", "4", 0, False, ("cpu", 4)),
    ("auto", 2, 0, False, ("cpu", 2)),  # what Lightning does; preflight refuses it (CPU processes by accident)
    ("auto", "auto", 8, False, ("cuda", 8)),  # every visible GPU
    ("gpu", "auto", 8, False, ("cuda", 8)),
    ("cuda", -1, 4, False, ("cuda", 4)),
    ("gpu", "-1", 4, False, ("cuda", 4)),
    ("gpu", 2, 4, False, ("cuda", 2)),
    ("gpu", "2", 4, False, ("cuda", 2)),  # a number as text is a count, not a device id
    ("gpu", [1, 3], 4, False, ("cuda", 2)),
    ("gpu", "0,3", 4, False, ("cuda", 2)),
    ("auto", "auto", 0, True, ("mps", 1)),
    ("gpu", "auto", 0, True, ("mps", 1)),
]


@pytest.mark.parametrize("accelerator,devices,cuda,mps,expected", TABLE)
def test_resolution_table(accelerator, devices, cuda, mps, expected):
    d = resolve(trainer(accelerator, devices, num_nodes=2), cuda, mps)
    assert (d.accelerator, d.per_node) == expected and d.world_size == 2 * expected[1]


def test_auto_in_an_interactive_session_is_one_gpu():
    assert resolve(trainer(), 8, False, interactive=True) == Devices("cuda", 1, 1)
    assert resolve(trainer(devices=8), 8, False, interactive=True) == Devices("cuda", 8, 1)


@pytest.mark.parametrize(
    "accelerator,devices,cuda,message",
    [
        ("gpu", 1, 0, r"trainer\.accelerator=gpu but no CUDA GPU is visible on this machine; use trainer=cpu"),
        ("cuda", "auto", 0, r"trainer\.accelerator=cuda but no CUDA GPU is visible"),
        ("mps", 1, 0, r"trainer\.accelerator=mps but no Apple MPS device is visible"),
        ("gpu", 8, 4, r"trainer\.devices=8 asks for 8 GPUs but 4 are visible on this machine; set trainer\.devices=4"),
        ("gpu", [0, 4], 4, r"trainer\.devices=\[0, 4\] asks for 2 GPUs but 4 are visible"),
        ("cpu", [0, 1], 0, r"trainer\.devices=\[0, 1\] picks GPUs .* on the CPU, .*set trainer\.devices=2"),
        ("cpu", "0,1", 8, r"trainer\.devices=0,1 picks GPUs"),
        ("auto", -1, 0, r"trainer\.devices=-1 picks GPUs .*set trainer\.devices=1"),
        ("cpu", 0, 0, r"trainer\.devices=0 is not allowed; it must be auto, -1"),
        ("tpu9", 1, 0, r"trainer\.accelerator='tpu9' is not allowed"),
    ],
)
def test_what_lightning_refuses_is_one_sentence(accelerator, devices, cuda, message):
    with pytest.raises(ConfigError, match=message):
        resolve(trainer(accelerator, devices), cuda, False)


LIGHTNING_CASES = [
    ("cpu", "auto"),
    ("auto", "auto"),
    ("cpu", 2),
    ("cpu", "2"),
    ("auto", 2),
    ("cpu", -1),
    ("cpu", [0, 1]),
    ("cpu", "0,1"),
    ("gpu", "auto"),
    ("gpu", 1),
    ("auto", -1),
    ("gpu", [0]),
]


@pytest.mark.parametrize("accelerator,devices", LIGHTNING_CASES)
def test_the_answer_is_lightnings_on_this_machine(accelerator, devices):
    """A real Trainer built with the same settings: the same accelerator and process count, or both refuse."""
    try:
        t = L.Trainer(accelerator=accelerator, devices=devices, logger=False, enable_checkpointing=False)
        lightning = (t.accelerator.__class__.__name__.removesuffix("Accelerator").lower(), t.num_devices)
    except Exception:  # TypeError, ValueError, MisconfigurationException: Lightning refuses
        lightning = "refused"
    cfg = compose(["trainer=default", f"trainer.accelerator={accelerator}", f"trainer.devices={devices!r}"])
    try:
        d = devices_of(cfg)
        ours = (d.accelerator, d.per_node)
    except ConfigError:
        ours = "refused"
    assert ours == lightning


@pytest.fixture
def eight_gpus(monkeypatch):
    """A machine with 8 visible 80 GiB GPUs, as `devices_of` and the memory plan read it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "GPU-80G")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


@pytest.mark.parametrize(
    "overrides,world",
    [
        (["trainer=cpu"], 1),
        (["trainer=cpu", "trainer.devices=2", "trainer.num_nodes=3"], 6),
        (["trainer=ddp_sim"], 2),
        (["trainer=fsdp"], 8),  # devices=auto: every GPU
        (["trainer=ddp", "trainer.num_nodes=2"], 16),
        (["trainer=gpu"], 1),
        (["trainer.devices='0,1,2'"], 3),
    ],
)
def test_the_presets_on_an_eight_gpu_machine(eight_gpus, overrides, world):
    assert devices_of(compose(overrides)).world_size == world


def test_fsdp_memory_is_sharded_over_the_real_world_size(eight_gpus, tmp_path):
    """`trainer=fsdp` with `devices=auto` on 8 GPUs x 2 nodes: weights, grads and AdamW state split 16 ways."""
    n = 1_000_000_000
    fsdp = compose(["trainer=fsdp", "trainer.num_nodes=2", "model=small", f"paths.output_dir={tmp_path}"])
    ddp = compose(["trainer=ddp", "trainer.num_nodes=2", "model=small", f"paths.output_dir={tmp_path}"])
    sharded = plan(fsdp, "bf16-mixed", devices_of(fsdp), fsdp.data.batch_size, n_params=n)
    whole = plan(ddp, "bf16-mixed", devices_of(ddp), ddp.data.batch_size, n_params=n)
    assert sharded.parts["weights+grads+adamw"] == n * ADAMW_BYTES_PER_PARAM // 16
    assert whole.parts["weights+grads+adamw"] == n * ADAMW_BYTES_PER_PARAM
    assert sharded.processes == whole.processes == 8  # per machine; each has its own GPU
    assert sharded.where == "GPU memory on GPU-80G" and sharded.needed == sharded.per_process


def test_auto_is_one_answer_for_memory_and_doctor(eight_gpus, make_cfg):
    """`devices=auto` on 8 GPUs: the memory plan and doctor's epoch count both see 8 processes."""
    cfg = make_cfg("trainer.accelerator=auto", "trainer.devices=auto")
    assert devices_of(cfg) == Devices("cuda", 8, 1)
    assert plan(cfg, "32-true", devices_of(cfg), cfg.data.batch_size).processes == 8
    rows, _ = check_datamodule(cfg)
    assert "(8 rank(s))" in rows[1].evidence


@pytest.fixture
def four_24gb_gpus(monkeypatch):
    """A machine with 4 visible 24 GiB bf16 GPUs, as `devices_of`, the precision and the memory plan read it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=24 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "GPU-24G")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


def test_doctor_says_whether_llama_1b_fits_four_24gb_gpus_and_what_to_set(four_24gb_gpus, tmp_path):
    """FSDP2 over 4 GPUs at the preset's 4 sequences: 4.6 GiB of sharded state, fits; at 8, activation checkpointing
    makes it fit; DDP's whole 18.4 GiB of state does not, and the answer is to shard it."""
    from steadylm.doctor.model_checks import check_memory
    from steadylm.memory import count_params

    def memory(*overrides):
        cfg = compose(["model=llama_1b", "trainer.devices=4", *overrides, f"paths.output_dir={tmp_path}"])
        return check_memory(cfg, count_params(cfg.model), cfg.data.batch_size)[0]

    fsdp = memory("trainer=fsdp")
    assert fsdp.status == OK and "weights+grads+adamw 4.60 GiB" in fsdp.evidence and "vs 24.00 GiB" in fsdp.evidence
    bigger = memory("trainer=fsdp", "data.batch_size=8")
    assert bigger.status == FAIL and bigger.fix == "it fits with model.activation_checkpointing=selective"
    ddp = memory("trainer=ddp")
    assert (
        ddp.status == FAIL
        and "weights+grads+adamw 18.42 GiB" in ddp.evidence
        and ddp.fix == "it fits with trainer=fsdp"
    )
