"""Checks before an agent starts anything: what would otherwise fail later, deep in torch, a worker or
a checkpoint save — and burn restarts or lose work on the way.

:func:`check` raises a :class:`~trainguard.contract.configbase.ConfigError` (the CLI prints
``trainguard: <what> (<YAML key> / <env var>): <fix>`` and exits 2) for:

* a state directory that is not private (:mod:`trainguard.agent.rundir`);
* another live agent on this node's control socket (:func:`trainguard.agent.control.socket_is_live`);
* an entrypoint script (or executable, or module) that does not exist;
* a checkpoint URL without a bucket, or a local checkpoint folder this user cannot create or write;
* a ``cost.price_table_file`` that is missing or malformed.

:func:`warnings` returns the conditions worth one warning at start (logged by the caller): a
multi-node job whose c10d store lives inside an agent (it dies with that node, pytorch#67742), and
torchrun's ``OMP_NUM_THREADS=1`` default being applied. They are pure functions of the config and
the environment, so tables of cases test them.
"""

from __future__ import annotations

import importlib.machinery
import ipaddress
import os
import shutil
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from trainguard.agent import rundir
from trainguard.agent.config import RendezvousConfig, TrainguardConfig, WorkersConfig
from trainguard.agent.workerenv import omp_default
from trainguard.contract.configbase import ConfigError
from trainguard.contract.protocol import control_socket_path

REMOTE_SCHEMES = ("s3", "gs", "gcs")


def check(cfg: TrainguardConfig, *, cwd: str | None = None) -> None:
    """Everything that must hold before the agent starts (see the module docstring)."""
    from trainguard.agent import control

    rundir.ensure_private_dir(cfg.agent.state_dir)
    path = control_socket_path(cfg.agent.state_dir, cfg.agent.job_id)
    check_socket_path(path)
    control.refuse_if_live(path, cfg.agent.job_id)
    check_entrypoint(cfg.workers, cwd=cwd)
    check_checkpoint_url(cfg.checkpoint.url)
    if cfg.cost.price_table_file:
        from trainguard.metrics.cost import load_price_table

        load_price_table(cfg.cost.price_table_file)


UNIX_PATH_MAX = 107
"""Longest path of a Unix socket (``sun_path`` is 108 bytes with its terminating NUL)."""


def check_socket_path(path: str) -> None:
    """The control socket's path fits a Unix socket address."""
    n = len(os.fsencode(path))
    if n > UNIX_PATH_MAX:
        raise ConfigError("agent.state_dir", f"the control socket path {path} is {n} bytes; Unix sockets allow "
                          f"{UNIX_PATH_MAX}", "choose a shorter agent.state_dir (or agent.job_id)")


def check_entrypoint(w: WorkersConfig, *, cwd: str | None = None) -> None:
    """The script, module or executable exists (a missing one would fail every restart)."""
    cwd = cwd or os.getcwd()
    key = "workers.entrypoint"
    if not w.entrypoint:
        raise ConfigError(key, "no training script given", "pass the script to `trainguard run`, or set it in the YAML")
    if w.no_python:
        found = shutil.which(w.entrypoint, path=os.environ.get("PATH")) if os.sep not in w.entrypoint else (
            w.entrypoint if os.access(os.path.join(cwd, w.entrypoint), os.X_OK) else None)
        if not found:
            raise ConfigError(key, f"executable {w.entrypoint!r} not found (or not executable)",
                              "give the path of an executable, or drop --no-python for a Python script")
        return
    if w.module:
        top = w.entrypoint.split(".", 1)[0]
        if importlib.machinery.PathFinder.find_spec(top, [cwd, *sys.path]) is None:
            raise ConfigError(key, f"module {w.entrypoint!r} not found (no {top!r} on the Python path from {cwd})",
                              "install the package into the agent's environment or start from its folder")
        return
    script = os.path.join(cwd, w.entrypoint)
    if not os.path.isfile(script):
        what = "is a directory" if os.path.isdir(script) else "does not exist"
        raise ConfigError(key, f"training script {script} {what}",
                          "check the path (relative paths start at the agent's working directory)")
    if not os.access(script, os.R_OK):
        raise ConfigError(key, f"training script {script} is not readable by this user", "fix its permissions")


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def local_path(url: str) -> str | None:
    """The local folder of a ``file://`` URL or a plain path; None for other schemes."""
    scheme = _scheme(url)
    if scheme != "file":
        return None
    return url[len("file://"):] if url.startswith("file://") else url


def check_url_shape(url: str) -> None:
    """A remote checkpoint URL names a bucket (``s3://`` alone would write to nowhere)."""
    scheme = _scheme(url)
    if url and scheme in REMOTE_SCHEMES:
        bucket = url.split("://", 1)[1].split("/", 1)[0]
        if not bucket:
            raise ConfigError("checkpoint.url", f"{url!r} names no bucket", f"write {scheme}://<bucket>/<prefix>")


def check_checkpoint_url(url: str) -> None:
    """:func:`check_url_shape`, and a local folder exists or can be created, and is writable."""
    key = "checkpoint.url"
    if not url:
        return
    check_url_shape(url)
    path = local_path(url)
    if path is None:
        return
    path = os.path.abspath(path)
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ConfigError(key, f"{probe} is not a folder, so {path} cannot be created",
                          "point checkpoint.url at a folder (or a path under one)")
    if not os.access(probe, os.W_OK | os.X_OK):
        verb = "write to" if probe == path else f"create {path} under"
        raise ConfigError(key, f"this user (uid {os.geteuid()}) cannot {verb} {probe}",
                          "choose a writable folder, or fix its owner/permissions (systemd units: add it to "
                          "ReadWritePaths=)")


# ---- warnings -----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StartWarning:
    event: str
    fields: dict[str, object]


def is_local_address(host: str) -> bool:
    """Whether ``host`` names this machine (torchrun's rule for hosting the c10d store)."""
    if host in ("localhost", "") or host.lower() == socket.gethostname().lower():
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    try:
        theirs = {a[4][0] for a in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
        ours = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return False
    return bool(theirs & ours) or any(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in theirs)


def store_in_agent(r: RendezvousConfig) -> bool:
    """Whether this agent hosts the rendezvous store of a job that may span several nodes."""
    if r.backend != "c10d" or r.max_nodes <= 1:
        return False
    if r.is_host is not None:
        return r.is_host
    return is_local_address(r.endpoint.rpartition(":")[0].strip("[]"))


def warnings(cfg: TrainguardConfig, env: Mapping[str, str]) -> list[StartWarning]:
    """What is worth one warning line at start (pure; see the module docstring)."""
    out: list[StartWarning] = []
    if store_in_agent(cfg.rendezvous):
        out.append(StartWarning("store_in_agent", {
            "endpoint": cfg.rendezvous.endpoint, "max_nodes": cfg.rendezvous.max_nodes,
            "effect": "the rendezvous store lives in this agent: if this node goes, every other node fails "
                      "(pytorch#67742)",
            "fix": "run `trainguard store` on an on-demand node and set rendezvous.is_host: false "
                   "(TRAINGUARD_RENDEZVOUS_IS_HOST=false) on every agent, or use etcd-v2; see docs/rendezvous.md"}))
    if omp_default(cfg.workers, env):
        out.append(StartWarning("omp_num_threads_defaulted", {
            "value": 1, "nproc_per_node": cfg.workers.nproc_per_node,
            "effect": "as torchrun does with several workers per node: each worker gets OMP_NUM_THREADS=1 so "
                      "they do not oversubscribe the CPU cores",
            "fix": "set OMP_NUM_THREADS (or workers.env) to tune it for your job"}))
    return out
