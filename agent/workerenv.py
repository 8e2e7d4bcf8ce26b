"""Worker environment defaults that keep ``trainguard run`` at parity with ``torchrun``.

torchrun sets ``OMP_NUM_THREADS=1`` (with a warning) when several workers share a node and the
user did not set it, so CPU jobs do not oversubscribe the cores; elastic then copies the agent's
``OMP_NUM_THREADS`` into every worker. Elastic itself writes the rest of torchrun's variables
(``RANK``, ``ROLE_NAME`` from the worker spec's role, which trainguard names ``default`` as torchrun
does, ...). Pure functions; the supervisor adds the result to each worker's environment.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from trainguard.agent.config import WorkersConfig
from trainguard.runtime.shim import SHIM_MODULE

AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""Set in the agent's own environment when the supervisor is imported (every worker inherits it): no
TCPStore shared between the agent and its workers (the module docstring of
:mod:`trainguard.agent.supervisor` says why)."""

ROLE = "default"
"""The worker role (``ROLE_NAME``, and the ``[default0]:`` prefix of tee'd worker output), as torchrun."""


def omp_default(w: WorkersConfig, inherited: Mapping[str, str]) -> bool:
    """Whether torchrun's ``OMP_NUM_THREADS=1`` default applies (several workers, nobody set it)."""
    return w.nproc_per_node > 1 and "OMP_NUM_THREADS" not in inherited and "OMP_NUM_THREADS" not in w.env


NCCL_ABORT_COMMUNICATOR_ONLY = "2"
"""``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``: on a failed or timed-out collective the watchdog aborts the
communicator and the error surfaces in the worker, which stays alive to re-form in place."""

FLIGHT_RECORDER_ENTRIES = "2000"
"""``TORCH_FR_BUFFER_SIZE`` for workers (unless set): collectives the flight recorder keeps."""

NCCL_TEAR_DOWN = "3"
"""``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` (torch's default): the watchdog ends the worker process; the
agent sees the exit and restarts the world."""


def gpu_defaults(w: WorkersConfig, inherited: Mapping[str, str], *, reform_in_process: bool) -> dict[str, str]:
    """GPU variables for the workers, unless the agent's environment or ``workers.env`` sets them.

    ``TORCH_NCCL_ASYNC_ERROR_HANDLING``: a hung or failed NCCL collective is detected by torch's
    watchdog after the process group's timeout (``workers.pg_timeout_s``) and never hangs the worker;
    with in-place re-formation the communicator is aborted and the worker survives to re-form,
    otherwise the worker exits and the world restarts. ``CUDA_DEVICE_ORDER=PCI_BUS_ID``: CUDA numbers
    the GPUs as NVML does (CUDA's default orders fastest first), so ``LOCAL_RANK`` k, the agent's
    NVML device k and ``nvidia-smi`` name the same GPU. Harmless without GPUs. ``TORCH_FR_BUFFER_SIZE``:
    the flight recorder keeps the last 2000 collectives (torch's default 0 keeps none), which a worker
    dumps when it parks for a lost peer (:mod:`trainguard.runtime.flight`)."""
    wanted = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": NCCL_ABORT_COMMUNICATOR_ONLY if reform_in_process else NCCL_TEAR_DOWN,
              "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "TORCH_FR_BUFFER_SIZE": FLIGHT_RECORDER_ENTRIES}
    return {k: v for k, v in wanted.items() if k not in inherited and k not in w.env}


def torchrun_defaults(w: WorkersConfig, inherited: Mapping[str, str]) -> dict[str, str]:
    """Variables torchrun would give these workers that elastic does not write itself."""
    return {"OMP_NUM_THREADS": "1"} if omp_default(w, inherited) else {}


def worker_defaults(w: WorkersConfig, inherited: Mapping[str, str]) -> dict[str, str]:
    """The worker variables that follow from the config and the agent's environment alone (torchrun's and
    the GPU defaults): the supervisor gives them to every worker, and a prestarted interpreter
    (:mod:`trainguard.agent.prestart`) starts with them."""
    return {**torchrun_defaults(w, inherited), **gpu_defaults(w, inherited, reform_in_process=w.reform == "in-process")}


def worker_log_format(w: WorkersConfig, configured: str, rendered: str) -> str:
    """The log format the workers render in (:attr:`RuntimeEnv.log_format
    <trainguard.contract.protocol.RuntimeEnv.log_format>`): the agent's own (``rendered``) while their
    output is tee'd to the agent's (``workers.tee``), so a terminal shows one format; not tee'd, their
    lines only reach their log files, and ``agent.log_format`` (``configured``) decides there, ``auto``
    on the worker's own stderr (a file: JSON). Empty: the worker decides (``auto``)."""
    if w.tee:
        return rendered
    return "" if configured == "auto" else configured


def worker_command(w: WorkersConfig) -> tuple[str, tuple[str, ...]]:
    """(entrypoint, args) for elastic: the orphan-safety shim, then the user's program."""
    if not w.entrypoint:
        raise ValueError("workers.entrypoint is empty: set YAML key `workers.entrypoint` or env var "
                         "TRAINGUARD_WORKERS_ENTRYPOINT (or pass the script to `trainguard run`)")
    shim = ["-m", SHIM_MODULE]
    if w.no_python:
        return sys.executable, (*shim, "--no-python", "--", w.entrypoint, *w.args)
    program = ["-u", "-m", w.entrypoint] if w.module else ["-u", w.entrypoint]
    return sys.executable, (*shim, "--", *program, *w.args)
