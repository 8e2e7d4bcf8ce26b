"""Worker environment defaults that keep ``trainguard run`` at parity with ``torchrun``.

torchrun sets ``OMP_NUM_THREADS=1`` (with a warning) when several workers share a node and the
user did not set it, so CPU jobs do not oversubscribe the cores; elastic then copies the agent's
``OMP_NUM_THREADS`` into every worker. Elastic itself writes the rest of torchrun's variables
(``RANK``, ``ROLE_NAME`` from the worker spec's role, which trainguard names ``default`` as torchrun
does, ...). Pure functions; the supervisor adds the result to each worker's environment.
"""

from __future__ import annotations

from collections.abc import Mapping

from trainguard.agent.config import WorkersConfig

ROLE = "default"
"""The worker role (``ROLE_NAME``, and the ``[default0]:`` prefix of tee'd worker output), as torchrun."""


def omp_default(w: WorkersConfig, inherited: Mapping[str, str]) -> bool:
    """Whether torchrun's ``OMP_NUM_THREADS=1`` default applies (several workers, nobody set it)."""
    return w.nproc_per_node > 1 and "OMP_NUM_THREADS" not in inherited and "OMP_NUM_THREADS" not in w.env


def torchrun_defaults(w: WorkersConfig, inherited: Mapping[str, str]) -> dict[str, str]:
    """Variables torchrun would give these workers that elastic does not write itself."""
    return {"OMP_NUM_THREADS": "1"} if omp_default(w, inherited) else {}
