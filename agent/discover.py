"""Find the live agents on this node, for ``trainguard drain`` and ``trainguard status`` run without
``--socket``.

Each agent listens on ``<state_dir>/<job_id>.sock`` (:func:`~trainguard.contract.protocol.control_socket_path`).
The CLI looks in every directory an agent of this user or the system service may use
(:func:`trainguard.agent.rundir.candidate_state_dirs`, plus the configured one), asks each socket
for its status, and keeps those that answer. One live agent: use it, and say which. Several: list
them and ask for ``--job-id``. None: say where it looked.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainguard.agent import control, rundir
from trainguard.contract import protocol as proto
from trainguard.contract.configbase import ConfigError

PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class LiveAgent:
    socket: str
    job_id: str
    status: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        s = self.status
        return (f"job {self.job_id} (node {s.get('node', '?')}, state {s.get('state', '?')}, "
                f"pid {s.get('pid', '?')}) at {self.socket}")


def sockets_in(dirs: list[str]) -> list[str]:
    out: list[str] = []
    for d in dirs:
        for p in sorted(glob.glob(os.path.join(glob.escape(d), "*.sock"))):
            if p not in out:
                out.append(p)
    return out


def probe(path: str, timeout_s: float = PROBE_TIMEOUT_S) -> LiveAgent | None:
    """The agent behind ``path`` if it answers a status request; None for a stale or foreign socket."""
    try:
        reply = control.request(path, proto.StatusRequest(), timeout=timeout_s)
    except (OSError, proto.ProtocolError, ConnectionError):
        return None
    if not reply.ok:
        return None
    job = str(reply.data.get("job_id") or os.path.basename(path).removesuffix(".sock"))
    return LiveAgent(path, job, dict(reply.data))


def live_agents(dirs: list[str], job_id: str | None = None) -> list[LiveAgent]:
    found = [a for a in (probe(p) for p in sockets_in(dirs)) if a is not None]
    return [a for a in found if job_id is None or a.job_id == job_id]


def search_dirs(env: Mapping[str, str], configured: str | None = None) -> list[str]:
    dirs = [configured] if configured and os.path.isdir(configured) else []
    return dirs + [d for d in rundir.candidate_state_dirs(env) if d not in dirs]


def find_one(env: Mapping[str, str], *, job_id: str | None = None, state_dir: str | None = None) -> LiveAgent:
    """The one live agent (matching ``job_id``), or a :class:`ConfigError` that lists what was found."""
    dirs = [state_dir] if state_dir else search_dirs(env)
    agents = live_agents(dirs, job_id)
    if len(agents) == 1:
        return agents[0]
    which = f" for job {job_id!r}" if job_id else ""
    if not agents:
        raise ConfigError("agent.state_dir", f"no live agent{which} on this node (looked in {', '.join(dirs) or 'nothing'})",
                          "is it running, and as this user? Pass --socket PATH (the agent logs it at start) or "
                          "--state-dir DIR")
    listing = "; ".join(a.describe() for a in agents)
    raise ConfigError("agent.job_id", f"{len(agents)} live agents on this node: {listing}",
                      "pick one with --job-id JOB (or --socket PATH)")
