"""An installed copy works outside the repo: the wheel carries `conf/`, and every command composes from it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_ships_conf_and_composes_outside_the_repo(tmp_path):
    wheels, site, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", str(ROOT), "-w", str(wheels)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), *map(str, wheels.glob("*.whl"))],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {**os.environ, "PYTHONPATH": str(site), "STEADYLM_ROOT": str(elsewhere)}
    env.pop("STEADYLM_CONF", None)
    code = (
        "import steadylm, steadylm.config as c; cfg = c.compose(['experiment=demo']); "
        "print(steadylm.__file__); print(c.CONF_DIR); print(cfg.data.vocab_size, cfg.data.tokenizer)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    module, conf, shape = proc.stdout.strip().splitlines()
    assert module.startswith(str(site)) and conf == str(site / "steadylm" / "conf")
    assert shape == "2048 bpe"  # an experiment's overrides on top of a preset, all from the wheel
    assert (site / "hydra_plugins" / "steadylm_parallel.py").is_file()  # hydra/launcher=parallel's registration
    proc = subprocess.run(
        [sys.executable, "-m", "steadylm.doctor", "--help"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "deep" in proc.stdout, proc.stderr[-2000:]
