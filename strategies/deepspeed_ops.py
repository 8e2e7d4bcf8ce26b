"""Load DeepSpeed's JIT-compiled CPU Adam op (what ZeRO-Offload steps with), every wait bounded.

DeepSpeed builds ``cpu_adam`` on first use with ninja and the host's C++ compiler into torch's
extension cache (about 75 s on a 2-core host; later loads take a second). torch serialises builders
with a lock *file* (``<build dir>/lock``, created exclusively, removed when the build ends, no owner
recorded); a builder killed mid-build leaves it behind, and every later process waits on it forever
(``FileBaton.wait`` has no timeout). That hung DeepSpeed's comm-op build once (see
``deepspeed.py``). Here:

1. A trainguard process first takes an ``flock`` on ``<build dir>/trainguard.lock``, polling, within
   ``timeout_s``. The kernel drops an ``flock`` when its holder dies, so it never goes stale; the local
   ranks of a node build once and the others load the result.
2. Holding it, a torch ``lock`` file that no live process has open is stale (torch keeps the file
   descriptor open for the whole build; checked in ``/proc/<pid>/fd``): it is removed and logged
   (``deepspeed_op_lock_removed``). One that a live process holds open (a build outside trainguard)
   is waited for, within ``timeout_s``.
3. Then DeepSpeed's builder builds or loads the op and caches the module for the process, so the
   ``DeepSpeedCPUAdam`` built afterwards finds it loaded.

A timeout or a failed build raises :class:`~trainguard.strategies.base.StrategyError` naming the lock
file or the compiler error and the fix.
"""

from __future__ import annotations

import fcntl
import os
import time
from typing import Any

from trainguard.contract.log import get_logger
from trainguard.strategies.base import StrategyError

log = get_logger("trainguard.strategies")

_POLL_S = 0.5


def build_directory(name: str) -> str:
    """torch's JIT build directory for the extension ``name`` (created if missing)."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(name, False)


def holders(path: str, proc: str = "/proc") -> list[int]:
    """Pids of live processes with ``path`` open (an empty list where ``/proc`` cannot tell)."""
    target = os.path.realpath(path)
    out = []
    try:
        pids = [e for e in os.listdir(proc) if e.isdigit()]
    except OSError:
        return []
    for pid in pids:
        fd_dir = os.path.join(proc, pid, "fd")
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(os.path.join(fd_dir, fd)) == target:
                    out.append(int(pid))
                    break
            except OSError:
                continue
    return out


def _flock(path: str, deadline: float) -> int:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise StrategyError(
                    f"deepspeed: timed out waiting for {path!r}, held by another process building DeepSpeed's "
                    f"cpu_adam op (ZeRO-Offload). Fix: let that build finish (it takes minutes once per host), or "
                    f"raise the deepspeed option op_build_timeout_s") from None
            time.sleep(_POLL_S)


def clear_stale_lock(lock: str, deadline: float) -> None:
    """Wait (until ``deadline``) for torch's build lock ``lock`` to go; remove it when nobody holds it."""
    while os.path.exists(lock):
        owners = holders(lock)
        if not owners:
            try:
                age = time.time() - os.path.getmtime(lock)
                os.remove(lock)
            except FileNotFoundError:
                return
            log.warning("deepspeed_op_lock_removed", lock=lock, age_s=round(age, 1),
                        reason="no live process holds it open (a build was killed)")
            return
        if time.monotonic() >= deadline:
            raise StrategyError(
                f"deepspeed: torch's extension build lock {lock!r} is held by pid(s) {owners} for longer than "
                f"op_build_timeout_s. Fix: let that build finish, or stop it and delete the lock file")
        time.sleep(_POLL_S)


def load_cpu_adam(timeout_s: float) -> Any:
    """Build (once per host) or load DeepSpeed's ``cpu_adam`` op; return the module."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    builder = CPUAdamBuilder()
    if not builder.is_compatible(False):
        raise StrategyError(f"deepspeed: the cpu_adam op ZeRO-Offload needs cannot be built here "
                            f"({builder.error_log or 'incompatible'}). Fix: install a C++ compiler and ninja, or "
                            f"remove offload_optimizer/offload_param from the DeepSpeed config")
    deadline = time.monotonic() + timeout_s
    build_dir = build_directory(builder.name)
    t0 = time.monotonic()
    fd = _flock(os.path.join(build_dir, "trainguard.lock"), deadline)
    try:
        clear_stale_lock(os.path.join(build_dir, "lock"), deadline)
        try:
            module = builder.load(verbose=False)
        except Exception as e:  # noqa: BLE001 - a compiler error becomes a setting error
            raise StrategyError(f"deepspeed: building the cpu_adam op for ZeRO-Offload failed in {build_dir}: "
                                f"{str(e)[-1500:]}. Fix: check the C++ compiler and ninja, or remove "
                                f"offload_optimizer/offload_param from the DeepSpeed config") from e
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    log.info("deepspeed_op_loaded", op=builder.name, build_dir=build_dir, seconds=round(time.monotonic() - t0, 2))
    return module


__all__ = ["build_directory", "clear_stale_lock", "holders", "load_cpu_adam"]
