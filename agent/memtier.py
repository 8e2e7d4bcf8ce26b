"""The agent's side of tier 0: it owns the node folder the workers' in-memory snapshots live in.

The folder (``<checkpoint.memory_dir>/trainguard-<job_id>-<node>/``, mode 0700, on a tmpfs) is created
by the agent before its workers start and removed by the agent when the job is over for this node
(succeeded, failed, or the node drained and left). Workers only create and map their slot files in
it (:mod:`trainguard.checkpoint.memory`), so a worker that dies, even by SIGKILL, leaves its last
snapshot for the worker the agent restarts. A SIGKILLed agent leaves the folder behind: the agent
restarted for the same job on this node finds it and its workers restore from it (a systemd restart
of a crashed agent); nothing else reads it.
"""

from __future__ import annotations

import os
import re
import shutil

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.contract.configbase import ConfigError
from trainguard.contract.log import get_logger

log = get_logger("trainguard.agent.memtier")

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def node_dir(root: str, job_id: str, node: str) -> str:
    """``<root>/trainguard-<job_id>-<node>`` (characters outside ``[A-Za-z0-9._-]`` become ``_``)."""
    return os.path.join(root, f"trainguard-{_UNSAFE.sub('_', job_id)}-{_UNSAFE.sub('_', node)}")


class NodeSnapshots:
    """The node folder of one job's tier-0 snapshots; :meth:`open` creates it, :meth:`remove` deletes it."""

    def __init__(self, cfg: CheckpointConfig, job_id: str, node: str) -> None:
        self.path = node_dir(cfg.memory_dir, job_id, node)
        self.enabled = bool(cfg.url) and cfg.memory_interval_steps > 0

    def open(self) -> str:
        """Create the folder (kept if it exists: a restarted agent's workers restore from it); return its
        path, or "" when tier 0 is off. Raises :class:`ConfigError` naming ``checkpoint.memory_dir`` (the
        CLI prints it and exits 2) when the folder cannot be made."""
        if not self.enabled:
            return ""
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
        except OSError as e:
            raise ConfigError("checkpoint.memory_dir", f"cannot create the in-memory snapshot folder {self.path}: "
                              f"{e.strerror}", "point it at a writable tmpfs such as /dev/shm, or set "
                              "checkpoint.memory_interval_steps=0 (TRAINGUARD_CHECKPOINT_MEMORY_INTERVAL_STEPS)",
                              value=self.path) from None
        held = sum(os.path.getsize(os.path.join(self.path, f)) for f in os.listdir(self.path))
        log.info("memory_tier_ready", path=self.path, bytes_held=held)
        return self.path

    def remove(self, reason: str) -> None:
        """Delete the folder and every snapshot in it (the job is over for this node). Never raises."""
        if not self.enabled or not os.path.isdir(self.path):
            return
        try:
            shutil.rmtree(self.path)
            log.info("memory_tier_removed", path=self.path, reason=reason)
        except OSError as e:
            log.warning("memory_tier_remove_failed", path=self.path, error=str(e))


__all__ = ["NodeSnapshots", "node_dir"]
