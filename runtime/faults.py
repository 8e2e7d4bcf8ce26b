"""Fault injection for tests, apart from the product runtime: what
:attr:`~trainguard.contract.protocol.RuntimeEnv.inject_fault` (``workers.env``, tests only) asks a
worker to do, once. Empty (the default) makes every hook a no-op.

* ``reform:<flag file>``: the next in-place re-formation fails in this worker (:meth:`FaultHooks.fail_at`),
  to exercise the fallback (restart the world);
* ``snapshot_written:<flag file>``: SIGKILL this worker once a tier-0 snapshot's data is written and
  before its commit (its slot torn; :meth:`FaultHooks.snapshot_written`);
* ``freeze_emergency_save:<flag file>``: SIGSTOP this worker as it starts its emergency checkpoint of a
  drain (:meth:`FaultHooks.freeze_at`): a node that vanishes without a TCP reset in the middle of the
  save, so that its peers' save collectives wait until the drain deadline and abandon it.

The flag file records that the fault fired (so it fires once per job); a test may create it first to
hold the fault back.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable


class FaultHooks:
    def __init__(self, spec: str = "") -> None:
        self.spec = spec
        self.point, _, self.flag = spec.partition(":")

    def fail_at(self, point: str) -> None:
        """Raise once at ``point`` when the spec names it."""
        if self.point != point or not self.flag or os.path.exists(self.flag):
            return
        with open(self.flag, "w") as fh:
            fh.write(f"{point} failed in pid {os.getpid()}\n")
        raise RuntimeError(f"injected fault at {point} (inject_fault={self.spec!r})")

    def freeze_at(self, point: str) -> None:
        """SIGSTOP this process once at ``point`` when the spec is ``freeze_<point>:<flag>`` (it stays
        stopped until someone sends SIGCONT or SIGKILL)."""
        if self.point != f"freeze_{point}" or not self.flag or os.path.exists(self.flag):
            return
        with open(self.flag, "w") as fh:
            fh.write(f"{point}: pid {os.getpid()} stopped\n")
        os.kill(os.getpid(), signal.SIGSTOP)

    def snapshot_written(self) -> Callable[[int], None] | None:
        """The tier's ``fault_hook`` (called with the step once a snapshot's data is written, before its
        commit), or None when the spec asks for none."""
        return self._kill_after_snapshot_write if self.spec.startswith("snapshot_written:") else None

    def _kill_after_snapshot_write(self, step: int) -> None:
        if os.path.exists(self.flag):
            return
        with open(self.flag, "w") as fh:
            fh.write(f"{step}\n")
        os.kill(os.getpid(), signal.SIGKILL)
