"""Registers `hydra/launcher=parallel` with Hydra, which takes launchers only from the `hydra_plugins` package;
the launcher is `steadylm.parallel`."""

from steadylm.parallel import ParallelLauncher as _ParallelLauncher


class ParallelLauncher(_ParallelLauncher):
    pass
