"""trainguard.agent: the per-node daemon (config, CLI, elastic supervisor, preemption handling).

The distribution installs one import namespace, ``trainguard.*``; this folder is
``trainguard.agent``. ``trainguard`` itself is an implicit namespace package.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("trainguard")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
