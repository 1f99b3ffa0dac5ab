"""`hydra/launcher=parallel`, registered where Hydra takes launchers from (the `hydra_plugins` package, imported by
every Hydra command at start): the class alone, its work in `steadylm.parallel`, loaded only when a sweep runs."""

from typing import Any

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher as Base
except ImportError:  # the `parallel` extra is missing: choosing the launcher says so in one line
    from hydra.plugins.launcher import Launcher as Base


class ParallelLauncher(Base):
    """submitit's local executor (hydra-submitit-launcher's LocalLauncher), at most `slots` jobs at once."""

    def __init__(
        self, slots: Any = None, pin_cores: bool = True, devices: Any = 1, accelerator: Any = "auto", **params
    ):
        if not hasattr(Base, "checkpoint"):  # not submitit's
            from steadylm.errors import ConfigError, exit_with

            exit_with(
                ConfigError('hydra/launcher=parallel needs hydra-submitit-launcher: pip install -e ".[parallel]"')
            )
        super().__init__(**params)
        self.slots, self.pin_cores, self.devices, self.accelerator = slots, bool(pin_cores), devices, accelerator

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # in the job's own process
        from steadylm.parallel import pin_job

        pin_job()
        return super().__call__(*args, **kwargs)

    def launch(self, job_overrides: Any, initial_job_idx: int) -> Any:
        from steadylm.parallel import launch

        return launch(self, job_overrides, initial_job_idx)
