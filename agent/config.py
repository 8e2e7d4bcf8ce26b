"""The agent's typed configuration: sections owned by each component, composed here.

Precedence: defaults < YAML file < ``TRAINGUARD_*`` environment < CLI flags. Every key has one
env var, derived mechanically (``rendezvous.min_nodes`` -> ``TRAINGUARD_RENDEZVOUS_MIN_NODES``; see
:func:`trainguard.contract.configbase.env_var_for`). The loader lives in
:mod:`trainguard.agent.configload`; this module only declares.
"""

from __future__ import annotations

import os
import re
import socket
import ssl
from dataclasses import dataclass, field

from trainguard.agent.hang import HangConfig
from trainguard.agent.health import HealthConfig
from trainguard.agent.straggler import StragglerConfig
from trainguard.agent.watchers.config import PreemptionConfig
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.contract.configbase import FieldError, env_var_for, require, require_finite
from trainguard.contract.protocol import STEP_AGREEMENT_PERIOD_S, STEP_AGREEMENTS
from trainguard.metrics.config import CostConfig, MetricsConfig

RDZV_BACKENDS = ("c10d", "etcd", "etcd-v2", "static")
RDZV_PROTOCOLS = ("auto", "dynamic", "keyed")
KEYED_ABOVE_NODES = 32
"""``rendezvous.protocol: auto`` resolves to ``keyed`` when ``max_nodes`` is above this (docs/rendezvous.md,
"Sizing the store for large jobs": at 32 nodes a ``dynamic`` change moves 2-4 MB and takes 0.5-2.6 s, at 128
it is 119-146 MB and 7-10 s; ``keyed`` is O(N) bytes per change)."""
KEYED_BACKENDS = ("c10d", "etcd")


def resolve_protocol(protocol: str, backend: str, max_nodes: int) -> str:
    """Pure: the rendezvous protocol a node runs, ``dynamic`` or ``keyed``. ``auto``: ``keyed`` on the ``c10d``
    or ``etcd`` backend when ``max_nodes`` > :data:`KEYED_ABOVE_NODES`, else ``dynamic``. Every node of a job
    resolves the same (``max_nodes`` is the job's ``--nnodes MAX``), so two protocols never share a store."""
    if protocol != "auto":
        return protocol
    return "keyed" if backend in KEYED_BACKENDS and max_nodes > KEYED_ABOVE_NODES else "dynamic"


ETCD_RENEWALS_PER_S = 400
"""Lease renewals per second one etcd core serves within 10 % of itself: 0.22-0.24 ms each measured at 1,024
simulated nodes on gRPC streams (``docs/benchmarks.md``, e611fee: 11.1-11.4 % at 512/s, 7.9-8.9 % at ~341/s)."""
KEEP_ALIVE_INTERVAL_S = 2
"""``keep_alive_interval_s`` when it is ``auto`` (null), except for a large keyed job on etcd."""


def etcd_keep_alive_advice(max_nodes: int, interval_s: float) -> int | None:
    """Pure: the smallest ``keep_alive_interval_s`` (whole seconds, as the setting) that keeps ``max_nodes``
    leases' renewals within :data:`ETCD_RENEWALS_PER_S`, or None when ``interval_s`` does already."""
    if max_nodes / interval_s <= ETCD_RENEWALS_PER_S:
        return None
    return -(-max_nodes // ETCD_RENEWALS_PER_S)


def auto_keep_alive_interval_s(backend: str, protocol: str, max_nodes: int) -> int:
    """Pure: ``keep_alive_interval_s: auto``. :data:`KEEP_ALIVE_INTERVAL_S` (2 s), except a ``keyed`` job on etcd
    whose ``max_nodes`` would renew more than :data:`ETCD_RENEWALS_PER_S` leases a second at 2 s: its interval
    is the smallest that does not (1,024 nodes: 3 s), so the keep-alives stay within 10 % of one etcd core.
    Every node of a job resolves the same (``max_nodes`` is the job's ``--nnodes MAX``)."""
    if backend == "etcd" and resolve_protocol(protocol, backend, max_nodes) == "keyed":
        return etcd_keep_alive_advice(max_nodes, KEEP_ALIVE_INTERVAL_S) or KEEP_ALIVE_INTERVAL_S
    return KEEP_ALIVE_INTERVAL_S


ETCD_ONLY_KEYS = ("ca_file", "cert_file", "key_file", "server_name", "username", "password", "password_file")
"""TLS and authentication settings; only the ``etcd`` backend has them (a TCPStore has neither)."""
LOG_FORMATS = ("auto", "json", "console")
JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""Upper bound of every timeout setting (a week): a larger value is a typo, not a plan."""
ENV_PASSWORD = env_var_for("rendezvous.password")


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    job_id: str = "trainguard"
    """Run id shared by every node of one job: the rendezvous id (torchrun ``--rdzv-id``) and the
    checkpoint run folder. Nodes with different ids never meet."""

    node_name: str = field(default_factory=socket.gethostname)
    """Name of this node in logs and metrics (defaults to the hostname)."""

    state_dir: str = ""
    """Agent-private runtime state: the control socket ``<state_dir>/<job_id>.sock`` and the workers'
    metrics files. Empty: ``$RUNTIME_DIRECTORY`` (systemd ``RuntimeDirectory=``), else
    ``$XDG_RUNTIME_DIR/trainguard``, else ``/tmp/trainguard-<uid>/state``. It must belong to the agent's
    user and not be writable by others (checked at start)."""

    log_dir: str = "/var/log/trainguard"
    """Per-rank worker logs go to ``<log_dir>/<job_id>/attempt_<n>/<rank>/``."""

    log_format: str = "auto"
    """``auto`` (JSON unless stderr is a TTY), ``json`` or ``console``. Workers that use the worker API log
    in the agent's format while their output is tee'd to the agent's (``workers.tee``)."""

    log_level: str = "info"
    """``debug``, ``info``, ``warning`` or ``error``."""

    def __post_init__(self) -> None:
        require(bool(JOB_ID_RE.match(self.job_id)), "job_id",
                f"must be 1-128 letters, digits, '.', '_' or '-' starting with a letter or digit, got {self.job_id!r}",
                "use a short name such as 'gpt-small-run1' (it names a folder of logs and checkpoints)")
        require(bool(self.node_name.strip()) and "/" not in self.node_name, "node_name",
                f"must be a non-empty name without '/', got {self.node_name!r}", "use the host name (the default)")
        require(self.log_format in LOG_FORMATS, "log_format", f"must be one of {list(LOG_FORMATS)}, got {self.log_format!r}",
                "use 'auto' unless you need to force one")
        require(self.log_level in {"debug", "info", "warning", "error"}, "log_level",
                f"must be debug/info/warning/error, got {self.log_level!r}", "use 'info'")


@dataclass(kw_only=True, slots=True)
class RendezvousConfig:
    backend: str = "c10d"
    """``c10d`` (TCPStore at ``endpoint``), ``etcd`` (etcd's v3 API, with TLS and authentication),
    ``etcd-v2`` (deprecated: etcd's v2 API, ``--enable-v2=true``, gone in etcd 3.6) or ``static``."""

    protocol: str = "auto"
    """How the nodes agree on each round. ``dynamic``: torch's dynamic rendezvous (one shared state with
    every node's heartbeat behind one compare-and-set key: O(N^2) store bytes per membership change, fine
    up to a few dozen nodes). ``keyed``: trainguard's (per-node heartbeat keys, one fenced decider that
    publishes each round; O(N) bytes per change; ``c10d`` or ``etcd``; survives a restarted ``trainguard store``
    and a partition as ``dynamic`` does). ``auto``: ``keyed`` when
    ``max_nodes`` is above 32 on ``c10d`` or ``etcd``, else ``dynamic`` (every node of a job resolves the
    same; the effective value is logged at start). See docs/rendezvous.md#two-protocols-dynamic-torchs-and-keyed-for-large-jobs."""

    @property
    def effective_protocol(self) -> str:
        """``protocol`` with ``auto`` resolved (:func:`resolve_protocol`): ``dynamic`` or ``keyed``."""
        return resolve_protocol(self.protocol, self.backend, self.max_nodes)

    endpoint: str = "127.0.0.1:29400"
    """``host:port`` of the rendezvous store (c10d) or of etcd; for ``etcd`` a comma-separated list of
    members (``10.0.0.5:2379,10.0.0.6:2379,10.0.0.7:2379``), tried in turn."""

    min_nodes: int = 1
    """Fewest nodes the job runs with; below it the survivors wait for nodes to join."""

    max_nodes: int = 1
    """Most nodes the job runs with; extra nodes wait as spares."""

    is_host: bool | None = None
    """c10d only: whether this agent hosts the store. ``None`` = host if the endpoint is a local address
    (torchrun's rule). Spot clusters should run ``trainguard store`` on an on-demand node and set
    ``false`` on every agent, since the store dies with the node that hosts it (pytorch#67742)."""

    local_addr: str = ""
    """Address other nodes use to reach this one (defaults to the hostname's FQDN)."""

    join_timeout_s: float = 600.0
    """How long a node waits for the rendezvous to form before it fails."""

    last_call_timeout_s: float = 2.0
    """Once ``min_nodes`` have joined, how long to wait for more before the round closes. A round that
    re-forms a running world in place (a drain, a join, a lost node) closes as soon as every member
    it expects has joined and does not wait this long; a late node then joins through a scale-up."""

    close_timeout_s: float = 30.0
    """Deadline of the close operation when the job ends."""

    keep_alive_interval_s: int | None = None
    """Heartbeat period (whole seconds, a torch limit). A node silent for interval x attempts is dead.
    ``auto`` (null): 2, except a ``keyed`` job on etcd with more than 800 ``max_nodes``: ``ceil(max_nodes /
    400)`` (1,024 nodes: 3), which keeps the leases' renewals within 10 % of one etcd core (docs/rendezvous.md,
    sizing). Resolved when the config loads; the agent logs the number it runs with."""

    keep_alive_max_attempts: int = 3
    """Missed heartbeats before a node is declared dead. interval x attempts < 4 s risks splitting a
    job into two worlds under load."""

    prefix: str = "/trainguard"
    """etcd only: key namespace. A job's keys (rendezvous state, agent store, drain record) live under
    ``<prefix>/<job_id>/``; its etcd user needs a role with ``readwrite`` on exactly that prefix."""

    ca_file: str = ""
    """etcd only: PEM bundle of the CA that signed etcd's server certificate. Set = talk HTTPS and
    verify etcd; empty = plain HTTP (the agent warns)."""

    cert_file: str = ""
    """etcd only: client certificate (PEM) for an etcd started with ``--client-cert-auth``. Needs
    ``key_file`` and ``ca_file``. It must have no Common Name when etcd also has authentication on."""

    key_file: str = ""
    """etcd only: private key (PEM, unencrypted) of ``cert_file``; keep it mode 0600."""

    server_name: str = ""
    """etcd only: name to verify etcd's certificate against (and send as SNI) when ``endpoint`` uses an
    address the certificate does not list. Empty = the endpoint's host."""

    username: str = ""
    """etcd only: etcd user of this job (``etcdctl user add``). Needs a password from ``password_file``
    or ``password``. Empty = no authentication (the agent warns)."""

    password: str = field(default="", repr=False)
    """etcd only: the user's password. Prefer ``password_file``; if you must, set it through the env
    var of this key (an EnvironmentFile of mode 0600), never in the YAML. Redacted, never logged."""

    password_file: str = ""
    """etcd only: file whose first line is the user's password (mode 0600, readable by the agent)."""

    def __post_init__(self) -> None:
        require(self.backend in RDZV_BACKENDS, "backend", f"must be one of {list(RDZV_BACKENDS)}, got {self.backend!r}",
                "use 'c10d' (with `trainguard store` for spot clusters) or 'etcd'")
        require(self.protocol in RDZV_PROTOCOLS, "protocol", f"must be one of {list(RDZV_PROTOCOLS)}, got {self.protocol!r}",
                "use 'auto' (keyed above 32 nodes), 'dynamic' (torch's rendezvous) or 'keyed' (for large jobs)")
        require(self.protocol != "keyed" or self.backend in KEYED_BACKENDS, "protocol",
                f"'keyed' runs on the c10d or etcd backend, not on {self.backend!r}",
                "set backend to 'c10d' (with `trainguard store`) or 'etcd', or protocol to 'dynamic'")
        require(self.min_nodes >= 1, "min_nodes", f"must be >= 1, got {self.min_nodes}", "set min_nodes to at least 1")
        require(self.max_nodes >= self.min_nodes, "max_nodes",
                f"max_nodes ({self.max_nodes}) must be >= min_nodes ({self.min_nodes})",
                "raise max_nodes or lower min_nodes (torchrun: --nnodes MIN:MAX)")
        endpoints = [e.strip() for e in self.endpoint.split(",")] if self.backend == "etcd" else [self.endpoint]
        for ep in endpoints:
            host, _, port = ep.rpartition(":")
            require(bool(host) and port.isdigit() and 0 < int(port) < 65536, "endpoint",
                    f"must be host:port{' (or a comma-separated list of them)' if self.backend == 'etcd' else ''}, "
                    f"got {self.endpoint!r}", "e.g. '10.0.0.5:29400'" if self.backend != "etcd" else "e.g. '10.0.0.5:2379'")
        if self.keep_alive_interval_s is None:
            self.keep_alive_interval_s = auto_keep_alive_interval_s(self.backend, self.protocol, self.max_nodes)
        require(self.keep_alive_interval_s >= 1, "keep_alive_interval_s", f"must be >= 1, got {self.keep_alive_interval_s}",
                "use whole seconds, e.g. 2")
        require(self.keep_alive_max_attempts >= 2, "keep_alive_max_attempts",
                f"must be >= 2, got {self.keep_alive_max_attempts}", "use 3: one lost heartbeat must not evict a node")
        for name, example in (("join_timeout_s", 600), ("last_call_timeout_s", 2), ("close_timeout_s", 30)):
            value = getattr(self, name)
            require_finite(value, name, positive=True, fix=f"torch needs a positive timeout; e.g. {example}")
            require(value <= MAX_TIMEOUT_S, name, f"must be at most {MAX_TIMEOUT_S:.0f} s (a week), got {value}",
                    f"e.g. {example}")
        require(self.keep_alive_interval_s <= 600, "keep_alive_interval_s",
                f"must be at most 600, got {self.keep_alive_interval_s}", "use 2: a node silent for interval x attempts is dead")
        require(self.backend != "static" or self.min_nodes == self.max_nodes, "backend",
                "the static backend cannot change size", "use c10d or etcd for an elastic job, or set min_nodes == max_nodes")
        self._check_etcd_security()

    def _check_etcd_security(self) -> None:
        """TLS and auth settings: only for ``etcd``, consistent, and their files readable and valid.

        Errors about the password name another field, so that the value shown is never the secret.
        """
        given = [k for k in ETCD_ONLY_KEYS if getattr(self, k)]
        require(self.backend == "etcd" or not given, "backend",
                f"{given} apply to backend 'etcd' only, but backend is {self.backend!r}",
                "use backend 'etcd' (v3, TLS and authentication), or remove those settings: c10d's TCPStore and "
                "torch's etcd-v2 backend have neither")
        require(self.prefix.startswith("/") and not any(c.isspace() for c in self.prefix), "prefix",
                f"must be an absolute key path without spaces, got {self.prefix!r}", "e.g. '/trainguard' or '/teams/ml'")
        for key in ("ca_file", "cert_file", "key_file", "password_file"):
            path = getattr(self, key)
            require(not path or os.path.isfile(path), key, f"file {path!r} does not exist",
                    f"give the path of an existing file (an absolute path; the agent's working directory is {os.getcwd()!r})")
            require(not path or os.access(path, os.R_OK), key, f"file {path!r} is not readable by this user",
                    "chmod/chown it so the agent's user can read it (keys and passwords: mode 0600 or 0640)")
        require(bool(self.cert_file) == bool(self.key_file), "key_file" if self.cert_file else "cert_file",
                "cert_file and key_file go together", "set both (the client certificate and its private key), or neither")
        require(not self.cert_file or bool(self.ca_file), "ca_file", "a client certificate is only sent over TLS, and ca_file is empty",
                "set ca_file to the CA that signed etcd's server certificate")
        require(not self.server_name or bool(self.ca_file), "server_name", "server_name is only used with TLS, and ca_file is empty",
                "set ca_file, or remove server_name")
        require(not (self.password and self.password_file), "password_file",
                f"both password_file and password (e.g. env {ENV_PASSWORD}) are set", "keep one of them")
        require(bool(self.username) or not (self.password or self.password_file), "username",
                "a password is configured but no username", "set username to the etcd user the password belongs to")
        require(not self.username or bool(self.password or self.password_file), "username",
                f"etcd user {self.username!r} has no password configured",
                f"set password_file (a file readable only by the agent) or env var {ENV_PASSWORD}")
        if self.password_file:
            with open(self.password_file, encoding="utf-8") as fh:
                first = fh.readline().rstrip("\r\n")
            require(bool(first), "password_file", f"file {self.password_file!r} has an empty first line",
                    "write the password on the first line of the file")
        if self.ca_file:
            try:
                ctx = ssl.create_default_context(cafile=self.ca_file)
            except (ssl.SSLError, ValueError) as e:
                raise FieldError("ca_file", f"{self.ca_file!r} is not a PEM CA bundle ({e})",
                                 "give the PEM file of the CA certificate(s) that signed etcd's server certificate") from None
            if self.cert_file:
                try:
                    ctx.load_cert_chain(self.cert_file, self.key_file)
                except ssl.SSLError as e:
                    raise _client_cert_error(self.cert_file, self.key_file, e) from None


def _client_cert_error(cert_file: str, key_file: str, err: ssl.SSLError) -> FieldError:
    """Which of the two files ``load_cert_chain`` choked on."""
    with open(cert_file, encoding="utf-8", errors="replace") as fh:
        is_cert = "-----BEGIN CERTIFICATE-----" in fh.read()
    if not is_cert:
        return FieldError("cert_file", f"{cert_file!r} is not a PEM certificate ({err})",
                          "give the client certificate in PEM (-----BEGIN CERTIFICATE-----)")
    if "KEY_VALUES_MISMATCH" in str(err):
        return FieldError("key_file", f"{key_file!r} is not the private key of {cert_file!r}",
                          "give the key the client certificate was issued for")
    return FieldError("key_file", f"{key_file!r} is not an unencrypted PEM private key ({err})",
                      "give the client key in PEM without a passphrase (openssl pkey -in KEY -out KEY.plain)")


PRESTART_IMPORTS = ("torch", "trainguard.runtime.runtime", "torch._dynamo")
"""``workers.prestart_imports`` by default."""

MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

@dataclass(kw_only=True, slots=True)
class WorkersConfig:
    entrypoint: str = ""
    """The training script (``train.py``) or, with ``module: true``, a module name. Required."""

    args: list[str] = field(default_factory=list, metadata={"text": "shell"})
    """Arguments passed to the script. As an env var or ``--set`` value: shell words
    (``TRAINGUARD_WORKERS_ARGS='--steps 50'`` is two arguments) or a JSON list."""

    module: bool = False
    """Run ``entrypoint`` as ``python -m <module>`` (torchrun ``-m``)."""

    no_python: bool = False
    """Run ``entrypoint`` as an executable instead of a Python script (torchrun ``--no-python``)."""

    nproc_per_node: int = 1
    """Worker processes on this node (one per GPU)."""

    max_restarts: int = 3
    """Restarts after worker *failures* before the job fails. Planned resizes (drain, scale-up) never
    consume one."""

    monitor_interval_s: float = 0.5
    """How often the agent polls its workers."""

    restart_backoff_s: float = 1.0
    """Wait before the first restart after a failure; doubles each time, up to ``restart_backoff_max_s``."""

    restart_backoff_max_s: float = 30.0
    """Cap of the restart backoff."""

    failure_stop_grace_s: float = 3.0
    """After a failure (a member or a worker lost), how long the local workers still running get
    between SIGTERM and SIGKILL before the restart. A worker blocked in a collective with a vanished
    peer cannot run its SIGTERM handler (the world it would checkpoint is broken anyway), so a long
    wait only delays recovery; torch elastic's own wait is 30 s. Drains keep their deadline."""

    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the workers (string values; shown redacted unless the name is on the
    allow-list of non-secret prefixes such as ``NCCL_``, ``OMP_``, ``CUDA_``)."""

    tee: bool = True
    """Copy worker stdout/stderr to the agent's stderr (prefixed with the rank) as well as the log files."""

    exit_barrier_timeout_s: float = 300.0
    """On success, how long at most to wait for the other members of the round whose workers still run
    (members that left the round are not waited for), and how long an agent that hosts the c10d store
    waits for the other nodes to exit before it takes the store away."""

    pg_timeout_s: float = 600.0
    """Timeout of every process group the worker runtime builds (``init_process_group`` and its gloo
    side groups): a collective or a process-group start that waits longer for a missing rank fails
    instead of hanging (torch's own default is 30 minutes for gloo)."""

    reform: str = "in-process"
    """How the world changes size for worker-API scripts: ``in-process`` (the workers that stay keep
    their processes and state; a joiner warms up before the world pauses for it; a failure falls back
    to ``restart``) or ``restart`` (every change restarts the workers, which restore from storage).
    Scripts without the worker API always restart."""

    reform_timeout_s: float = 120.0
    """How long a parked worker waits for its new world (and a joiner's workers for theirs) before it
    gives up and the agent restarts the world."""

    prestart: bool = True
    """Start one interpreter per worker first thing, before the agent's own imports: it imports
    ``prestart_imports`` while the agent starts up and waits for its first world, and the node's first
    worker start adopts it (same pid, log files and environment as a fresh worker) instead of starting a
    process that imports them then. It is adopted only if the worker's environment differs from the one
    it was started in by rank variables alone (else it is ended and the worker starts afresh,
    ``prestart_discarded``). Each holds its imports' memory (a few hundred MB with torch) until then.
    Not with ``no_python``; restarts start their workers afresh."""

    prestart_imports: list[str] = field(default_factory=lambda: list(PRESTART_IMPORTS), metadata={"text": "shell"})
    """Modules the prestarted interpreters import before the hand-over (a failing one is reported and
    skipped). The default is what a worker-API script imports anyway: torch, the worker runtime, and
    ``torch._dynamo``, which torch's optimizers import at their first construction. As an env var or
    ``--set`` value: shell words or a JSON list."""

    step_agreement: str = "overlapped"
    """How worker-API ranks agree at a step boundary on a stop, a re-formation or a checkpoint (a
    7-integer all-reduce over a gloo side group): ``overlapped`` (the exchange of step N runs beside
    step N+1 and is acted on at its end: nothing waits on the wire, decisions come one step later) or
    ``blocking`` (exchanged and acted on at step N: one round trip per step). Set it alike on every
    node: a world whose ranks differ agrees blocking (``step_agreement_mixed``)."""

    step_agreement_period_s: float = STEP_AGREEMENT_PERIOD_S
    """Overlapped, how often (seconds of training) the ranks agree: every as many whole steps as fit
    (by the mean step time; every step when a step is longer; a divisor of ``checkpoint.interval_steps``
    when that is set; at most 64), the world taking the smallest of its ranks' proposals. Between two
    agreements a step pays for no exchange, which a sub-second step would feel; a stop or an
    out-of-cycle checkpoint then waits up to this long plus a step. 0: agree at every step."""

    def __post_init__(self) -> None:
        require(self.nproc_per_node >= 1, "nproc_per_node", f"must be >= 1, got {self.nproc_per_node}",
                "set it to the number of GPUs (or CPU workers) on this node")
        require(self.max_restarts >= 0, "max_restarts", f"must be >= 0, got {self.max_restarts}", "use 0 to never restart")
        require(self.monitor_interval_s > 0, "monitor_interval_s", f"must be > 0, got {self.monitor_interval_s}", "e.g. 0.5")
        require(self.restart_backoff_s >= 0, "restart_backoff_s", f"must be >= 0, got {self.restart_backoff_s}", "e.g. 1")
        require(self.monitor_interval_s <= 60, "monitor_interval_s", f"must be at most 60, got {self.monitor_interval_s}",
                "e.g. 0.5")
        require(self.restart_backoff_max_s <= 3600, "restart_backoff_max_s",
                f"must be at most 3600, got {self.restart_backoff_max_s}", "e.g. 30")
        require(0 < self.failure_stop_grace_s <= 300, "failure_stop_grace_s",
                f"must be within (0, 300] s, got {self.failure_stop_grace_s}", "e.g. 3")
        require(self.exit_barrier_timeout_s > 0, "exit_barrier_timeout_s", f"must be > 0, got {self.exit_barrier_timeout_s}",
                "e.g. 300")
        require(self.exit_barrier_timeout_s <= MAX_TIMEOUT_S, "exit_barrier_timeout_s",
                f"must be at most {MAX_TIMEOUT_S:.0f}, got {self.exit_barrier_timeout_s}", "e.g. 300")
        require(10 <= self.pg_timeout_s <= 24 * 3600, "pg_timeout_s", f"must be within 10..86400 s, got {self.pg_timeout_s}",
                "e.g. 600; longer than the slowest step or checkpoint save, short enough that a lost rank is noticed")
        require(self.restart_backoff_max_s >= self.restart_backoff_s, "restart_backoff_max_s",
                f"must be >= restart_backoff_s ({self.restart_backoff_s}), got {self.restart_backoff_max_s}", "e.g. 30")
        require(not (self.module and self.no_python), "module", "module and no_python are mutually exclusive",
                "choose one way to start the entrypoint")
        require(self.reform in ("in-process", "restart"), "reform", f"must be in-process or restart, got {self.reform!r}",
                "use 'in-process' (default) or 'restart'")
        require(0 < self.reform_timeout_s <= 3600, "reform_timeout_s",
                f"must be within (0, 3600] seconds, got {self.reform_timeout_s}", "e.g. 120")
        for name in self.prestart_imports:
            require(isinstance(name, str) and MODULE_NAME.fullmatch(name) is not None, "prestart_imports",
                    f"{name!r} is not a module name", "give dotted module names, e.g. torch torch._dynamo")
        require(self.step_agreement in STEP_AGREEMENTS, "step_agreement",
                f"must be one of {', '.join(STEP_AGREEMENTS)}, got {self.step_agreement!r}",
                "use 'overlapped' (default) or 'blocking'")
        require(0 <= self.step_agreement_period_s <= 60, "step_agreement_period_s",
                f"must be within 0..60 s, got {self.step_agreement_period_s}",
                "e.g. 0.5; well under the drain lead and the SIGTERM grace period (0: every step)")


@dataclass(kw_only=True, slots=True)
class TrainguardConfig:
    agent: AgentConfig = field(default_factory=AgentConfig)
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    hang: HangConfig = field(default_factory=HangConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    health: HealthConfig = field(default_factory=HealthConfig)


SECTIONS: dict[str, type] = {
    "agent": AgentConfig,
    "rendezvous": RendezvousConfig,
    "workers": WorkersConfig,
    "checkpoint": CheckpointConfig,
    "preemption": PreemptionConfig,
    "metrics": MetricsConfig,
    "cost": CostConfig,
    "hang": HangConfig,
    "straggler": StragglerConfig,
    "health": HealthConfig,
}
