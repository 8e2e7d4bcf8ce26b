"""The worker <-> agent <-> CLI protocol: one module both ends import (torchft keeps its whole wire
format in one file the same way).

It holds, and nothing else in trainguard spells them out again:

* :class:`RuntimeEnv` — the environment contract. The agent writes it for every worker with
  :meth:`RuntimeEnv.to_env`; the worker reads it with :meth:`RuntimeEnv.from_env`. This is the only
  reader and writer of ``TRAINGUARD_RT_*`` variables.
* the exit-code contract (:data:`EXIT_RESIZE`, :func:`classify_exit`);
* the value enums that cross a process or module boundary — :class:`AgentState`,
  :class:`StopReason`, :class:`CheckpointKind`, :class:`WorkerStatus`, :class:`NoticeSource` — from
  which metric label values are derived, so they cannot drift;
* the control messages over the agent's Unix socket and their line-JSON codec
  (:func:`encode`, :func:`decode`), validated on decode: a bad message is a :class:`ProtocolError`
  the server answers with ``{"op": "reply", "ok": false, "error": ...}``;
* where the control socket lives (:func:`control_socket_path`).

This is a leaf module: it imports nothing of trainguard and nothing heavier than the standard
library, so the agent, the CLI, the checkpoint and metrics code may all import it.

Control channel (newline-delimited JSON objects over a Unix socket, one ``op`` each):

* worker -> agent :class:`Hello` once per connection: this worker uses the worker API and will honour
  stop orders; the connection stays open.
* agent -> worker :class:`Stop`: checkpoint at an agreed step boundary, then stop (``reason`` drain
  or resize; ``deadline`` for a drain, epoch seconds).
* agent -> worker :class:`CheckpointNow`: one out-of-cycle checkpoint (an early warning), keep training.
* worker -> agent :class:`Parked`, agent -> worker :class:`Reform`: in-place re-formation. A live
  worker that survives a membership change tears its process groups down and parks; once the agent
  has re-formed the rendezvous it sends each parked worker its new rank, world size and store.
* worker -> agent :class:`Committed`: a checkpoint committed (or, with ``saved=false``, could not be
  saved: the work since ``last_committed`` is lost); :class:`Restored`: the workers restored a step.
* worker -> agent :class:`Progress`: a heartbeat with the worker's step and :class:`Phase` (hang
  detection: progress, not liveness); agent -> worker :class:`Abort`: end the world's collectives now.
* CLI -> agent :class:`DrainRequest`, :class:`StatusRequest`: one request, one :class:`Reply`.
"""

from __future__ import annotations

import json
import math
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum, IntEnum
from typing import Any, ClassVar

# ---- value enums --------------------------------------------------------------------------------


class AgentState(str, Enum):
    """States of the agent (the transitions live in :mod:`trainguard.agent.states`)."""

    STARTING = "starting"
    RENDEZVOUS = "rendezvous"
    RUNNING = "running"
    DRAINING = "draining"
    RESIZING = "resizing"
    RESTARTING = "restarting"
    STOPPED = "stopped"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (AgentState.STOPPED, AgentState.SUCCEEDED, AgentState.FAILED)


class StopReason(IntEnum):
    """Why the workers stop at a step boundary. The integer is what ranks all-reduce (MAX) at the
    step boundary, so the most urgent request wins on every rank."""

    NONE = 0
    RESIZE = 1
    """A node waits to join (scale-up) or a peer left: checkpoint, then re-form."""
    DRAIN = 2
    """This job loses a node (a notice): emergency checkpoint, then re-form without it."""

    @property
    def checkpoint_kind(self) -> CheckpointKind:
        return CheckpointKind.EMERGENCY if self is StopReason.DRAIN else CheckpointKind.RESIZE

    @property
    def wire(self) -> str:
        return self.name.lower()

    @classmethod
    def from_wire(cls, value: str) -> StopReason:
        try:
            r = cls[str(value).upper()]
        except KeyError:
            raise ProtocolError(f"unknown stop reason {value!r} (expected drain or resize)") from None
        if r is StopReason.NONE:
            raise ProtocolError("stop reason 'none' is not an order")
        return r


class CheckpointKind(str, Enum):
    """``kind`` of a checkpoint: in manifests, logs and the ``kind`` label of checkpoint metrics."""

    PERIODIC = "periodic"
    """The interval save (asynchronous)."""
    EMERGENCY = "emergency"
    """Taken on a drain, at the step every rank agreed on."""
    RESIZE = "resize"
    """Taken before the world re-forms for a scale-up (or a peer's departure)."""
    FINAL = "final"
    """Taken by :meth:`Runtime.finish` at the end of training."""
    NOTICE = "notice"
    """Taken out of cycle on an early-warning notice (AWS rebalance, GCP live migration, ...); the
    node stays in the job."""


class CheckpointTier(str, Enum):
    """Where a restore found the state it loaded: the ``tier`` of logs and of the restore metric."""

    MEMORY = "memory"
    """Tier 0: the snapshots in this node's agent-owned shared memory (every rank its own)."""
    PEER = "peer"
    """Tier 1: some ranks loaded the replica a buddy node held of their snapshot (the rest their own)."""
    STORAGE = "storage"
    """Tier 2: a committed checkpoint in storage (``checkpoint.url``)."""
    NONE = "none"
    """Nothing to restore: the run starts at step 0."""


class ParkReason(str, Enum):
    """Why a live worker waits for a new world instead of exiting (in-place re-formation)."""

    DRAIN = "drain"
    """A peer node drains; this worker survives it (after the emergency checkpoint)."""
    RESIZE = "resize"
    """A node joins (scale-up)."""
    PEER_LOST = "peer_lost"
    """A collective failed: a peer vanished without notice."""
    STANDBY = "standby"
    """A joiner's worker is warmed up (started, imported, model built) and waits for its first world."""


class WorkerStatus(str, Enum):
    """What the agent sees of its local worker group in one observation."""

    HEALTHY = "healthy"
    EXITED = "exited"
    """Every local worker has exited (see the exit codes)."""
    UNKNOWN = "unknown"
    """The process context reported something else (treated as a crash)."""


class Phase(str, Enum):
    """Where a worker is, as its progress heartbeat says (:class:`Progress`): the ``phase`` of hang logs
    and of the ``trainguard_hangs_detected_total`` metric."""

    STEP = "step"
    """Training: forward, backward, the optimizer step (and the collectives inside them)."""
    AGREEMENT = "agreement"
    """Waiting for the step-boundary agreement of the flags (a collective)."""
    SAVE = "save"
    """Saving a checkpoint (bounded by its own storage deadline: never a hang)."""
    RESTORE = "restore"
    """Restoring a checkpoint or receiving the live state (bounded by its own deadlines: never a hang)."""
    BUSY = "busy"
    """The script said so (``Runtime.busy``): e.g. a rank-0-only evaluation between steps (never a hang)."""
    PARKED = "parked"
    """Between worlds (in-place re-formation; bounded by ``workers.reform_timeout_s``: never a hang)."""


class EvictionCause(str, Enum):
    """Why a node's workers were ended or a node removed from the world: the ``cause`` of eviction
    logs and of ``trainguard_evictions_total``."""

    HANG = "hang"
    """Its rank hung (no progress, named the culprit): its agent ended its workers; they rejoin."""
    FROZEN = "frozen"
    """The node froze (its agent stopped publishing too): its peers removed it from the rendezvous."""
    LOST = "lost"
    """A collective failed (connection reset) and the node's agent missed a heartbeat: removed at once."""
    QUARANTINE = "quarantine"
    """Its rank hung twice within ``hang.quarantine_s``: the node left the job."""
    STRAGGLER = "straggler"
    """A sustained straggler the job is faster without: drained (counted by the deciding node)."""
    GPU_HEALTH = "gpu_health"
    """A fatal GPU condition (NVML): the node drained itself (counted by the sick node)."""


class NoticeSource(str, Enum):
    """Where a preemption notice came from: the ``source`` of notices, logs and metrics."""

    AWS = "aws"
    GCP = "gcp"
    AZURE = "azure"
    SIGNAL = "signal"
    MANUAL = "manual"


class ExitKind(str, Enum):
    """A finished worker group classified by its exit codes (:func:`classify_exit`)."""

    SUCCESS = "success"
    RESIZE = "resize"
    CRASH = "crash"


# ---- exit codes ---------------------------------------------------------------------------------

EXIT_SUCCESS = 0
EXIT_RESIZE = 75
"""``EX_TEMPFAIL``: "a checkpoint of the current step is committed (or this node is drained); restart
me at the new world size". It never consumes one of ``workers.max_restarts``."""

# Codes the process context reports for siblings it terminated after the first worker exited.
_TERMINATED_BY_AGENT = frozenset({-int(signal.SIGTERM), -int(signal.SIGKILL), 128 + int(signal.SIGTERM)})


def classify_exit(exit_codes: list[int] | tuple[int, ...]) -> ExitKind:
    """Classify a finished worker group by its exit codes.

    When one local worker exits, elastic's process context terminates its siblings (SIGTERM), so a
    node whose workers resized reports one ``75`` and some ``-15``: that still is a resize, because
    every rank committed the checkpoint before any of them exited. Anything else is a crash.
    """
    if not exit_codes or all(c == EXIT_SUCCESS for c in exit_codes):
        return ExitKind.SUCCESS
    if EXIT_RESIZE in exit_codes and all(c in (EXIT_RESIZE, EXIT_SUCCESS) or c in _TERMINATED_BY_AGENT
                                         for c in exit_codes):
        return ExitKind.RESIZE
    return ExitKind.CRASH


# ---- the environment contract -------------------------------------------------------------------

RT_PREFIX = "TRAINGUARD_RT_"

STEP_AGREEMENTS = ("overlapped", "blocking")
"""How the ranks agree at a step boundary (``workers.step_agreement``): ``overlapped`` exchanges the
flags of step N beside step N+1 and acts on them at N+1; ``blocking`` exchanges and acts at N."""


STEP_AGREEMENT_PERIOD_S = 0.5
"""The default of ``workers.step_agreement_period_s``: overlapped ranks agree about this often."""


@dataclass(frozen=True, slots=True)
class RuntimeEnv:
    """What a worker learns from its environment.

    ``TRAINGUARD_RT_*`` fields are written by the agent (:meth:`to_env`); the torchelastic fields
    (``rank``, ``world_size``, ...) are written by torch's launcher and only read here. Under plain
    ``torchrun`` (no agent) the ``TRAINGUARD_RT_*`` fields are absent and take their defaults;
    ``TRAINGUARD_CHECKPOINT_URL`` then names the checkpoint URL, the same variable as the agent's
    config key ``checkpoint.url``.
    """

    job_id: str = ""
    node: str = ""
    agent_pid: int | None = None
    control_path: str = ""
    round: int = -1
    """The rendezvous round the worker group started in (informational: fencing uses epochs)."""
    checkpoint: dict[str, Any] = field(default_factory=dict)
    """The agent's ``checkpoint`` config section (see :class:`trainguard.checkpoint.config.CheckpointConfig`)."""
    pg_timeout_s: float = 0.0
    """Timeout of every process group the runtime builds (0: torch's default)."""
    reform: bool = False
    """The agent re-forms worlds in place: a surviving worker parks for a :class:`Reform` instead of
    exiting (``workers.reform: in-process``)."""
    reform_timeout_s: float = 120.0
    """How long a parked worker waits for its :class:`Reform` before it exits for a restart."""
    standby: bool = False
    """Started before its world exists (a joiner warming up): wait for a :class:`Reform` in ``setup``."""
    memory_dir: str = ""
    """This node's tier-0 snapshot folder, created and removed by the agent (empty: no tier 0)."""
    step_agreement: str = "overlapped"
    """``workers.step_agreement`` (see :data:`STEP_AGREEMENTS`)."""
    step_agreement_period_s: float = 0.0
    """``workers.step_agreement_period_s``: overlapped, the ranks agree about this often (0: every step)."""
    log_format: str = ""
    """``json`` or ``console``: the format the worker's log lines are rendered in, as the agent's own
    (tee'd to the agent's output, they look alike); empty: decided on the worker's stderr, as under
    torchrun (``auto``, see :func:`trainguard.contract.log.configure`)."""
    progress_interval_s: float = 0.0
    """``hang.heartbeat_interval_s``: how often the worker sends :class:`Progress` (0: never; hang
    detection off)."""
    inject_fault: str = ""
    """Fault injection for tests (``workers.env``): ``reform:<flag file>`` makes the next in-place
    re-formation fail in the worker once (the flag file records that it did), to exercise the fallback;
    ``snapshot_written:<flag file>`` kills it once mid-snapshot (:mod:`trainguard.runtime.faults`)."""
    # torchelastic's variables, read only
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    run_id: str = ""
    master_addr: str = ""
    master_port: int = 0

    _RT_FIELDS: ClassVar[tuple[str, ...]] = ("job_id", "node", "agent_pid", "control_path", "round",
                                             "checkpoint", "pg_timeout_s", "reform", "reform_timeout_s", "standby",
                                             "memory_dir", "step_agreement", "step_agreement_period_s",
                                             "log_format", "progress_interval_s", "inject_fault")

    def to_env(self) -> dict[str, str]:
        """The ``TRAINGUARD_RT_*`` variables (torchelastic writes its own)."""
        out: dict[str, str] = {}
        for name in self._RT_FIELDS:
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool):
                out[RT_PREFIX + name.upper()] = "1" if v else "0"
            else:
                out[RT_PREFIX + name.upper()] = json.dumps(v) if isinstance(v, dict) else str(v)
        return out

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RuntimeEnv:
        """Read the contract from ``env`` (``os.environ`` by default). Raises :class:`ProtocolError`
        naming the variable when one is malformed."""
        env = os.environ if env is None else env

        def get(name: str) -> str | None:
            return env.get(RT_PREFIX + name.upper())

        def num(var: str, raw: str | None, conv: Any, default: Any) -> Any:
            if raw is None or raw == "":
                return default
            try:
                return conv(raw)
            except ValueError:
                raise ProtocolError(f"environment variable {var}={raw!r} is not a number; it is set by the "
                                    f"trainguard agent or torchrun: do not override it") from None

        raw_ck = get("checkpoint")
        try:
            checkpoint = json.loads(raw_ck) if raw_ck else {}
            if not isinstance(checkpoint, dict):
                raise ValueError("not an object")
        except ValueError as e:
            raise ProtocolError(f"environment variable {RT_PREFIX}CHECKPOINT is not a JSON object ({e}); it is set "
                                f"by the trainguard agent: do not override it") from None
        if not checkpoint.get("url") and env.get("TRAINGUARD_CHECKPOINT_URL"):
            checkpoint = {**checkpoint, "url": env["TRAINGUARD_CHECKPOINT_URL"]}
        pid = get("agent_pid")
        return cls(
            job_id=get("job_id") or "",
            node=get("node") or "",
            agent_pid=num(RT_PREFIX + "AGENT_PID", pid, int, None),
            control_path=get("control_path") or "",
            round=num(RT_PREFIX + "ROUND", get("round"), int, -1),
            checkpoint=checkpoint,
            pg_timeout_s=num(RT_PREFIX + "PG_TIMEOUT_S", get("pg_timeout_s"), float, 0.0),
            reform=get("reform") == "1",
            reform_timeout_s=num(RT_PREFIX + "REFORM_TIMEOUT_S", get("reform_timeout_s"), float, 120.0),
            standby=get("standby") == "1",
            memory_dir=get("memory_dir") or "",
            step_agreement=_step_agreement(get("step_agreement")),
            step_agreement_period_s=num(RT_PREFIX + "STEP_AGREEMENT_PERIOD_S", get("step_agreement_period_s"), float, 0.0),
            log_format=_log_format(get("log_format")),
            progress_interval_s=num(RT_PREFIX + "PROGRESS_INTERVAL_S", get("progress_interval_s"), float, 0.0),
            inject_fault=get("inject_fault") or "",
            rank=num("RANK", env.get("RANK"), int, 0),
            local_rank=num("LOCAL_RANK", env.get("LOCAL_RANK"), int, 0),
            world_size=num("WORLD_SIZE", env.get("WORLD_SIZE"), int, 1),
            local_world_size=num("LOCAL_WORLD_SIZE", env.get("LOCAL_WORLD_SIZE"), int, 1),
            run_id=env.get("TORCHELASTIC_RUN_ID", ""),
            master_addr=env.get("MASTER_ADDR", ""),
            master_port=num("MASTER_PORT", env.get("MASTER_PORT"), int, 0),
        )

    @property
    def under_agent(self) -> bool:
        """Whether a trainguard agent started this worker (else: plain torchrun, or alone)."""
        return self.agent_pid is not None


def control_socket_path(state_dir: str, job_id: str) -> str:
    """The agent's control socket: ``<state_dir>/<job_id>.sock`` (the one place this is derived)."""
    return os.path.join(state_dir, f"{job_id}.sock")


# ---- control messages ---------------------------------------------------------------------------


class ProtocolError(ValueError):
    """A malformed control message or environment variable; the text says which field and why."""


def _step_agreement(raw: str | None) -> str:
    if not raw:
        return "overlapped"
    if raw not in STEP_AGREEMENTS:
        raise ProtocolError(f"environment variable {RT_PREFIX}STEP_AGREEMENT={raw!r} is not one of "
                            f"{', '.join(STEP_AGREEMENTS)}; it is set by the trainguard agent from workers.step_agreement")
    return raw


def _log_format(raw: str | None) -> str:
    if raw and raw not in ("json", "console"):
        raise ProtocolError(f"environment variable {RT_PREFIX}LOG_FORMAT={raw!r} is not json or console; it is set "
                            f"by the trainguard agent from agent.log_format: do not override it")
    return raw or ""


def _finite(name: str, v: Any, *, positive: bool = False, optional: bool = False) -> float | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ProtocolError(f"`{name}` must be a number, got {v!r}")
    f = float(v)
    if not math.isfinite(f):
        raise ProtocolError(f"`{name}` must be finite, got {v!r}")
    if positive and f <= 0:
        raise ProtocolError(f"`{name}` must be > 0, got {v!r}")
    return f


def _int(name: str, v: Any, *, minimum: int | None = None, optional: bool = False) -> int | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(f"`{name}` must be an integer, got {v!r}")
    if minimum is not None and v < minimum:
        raise ProtocolError(f"`{name}` must be >= {minimum}, got {v!r}")
    return v


def _str(name: str, v: Any, *, limit: int = 200) -> str:
    if not isinstance(v, str):
        raise ProtocolError(f"`{name}` must be a string, got {v!r}")
    return v[:limit]


def _enum(name: str, cls: type[Enum], v: Any) -> Any:
    """``cls(v)``, or a :class:`ProtocolError` naming the field and the values it takes."""
    try:
        return cls(v)
    except ValueError:
        raise ProtocolError(f"`{name}` must be one of {[m.value for m in cls]}, got {v!r}") from None


class Message:
    """Base of the control messages: ``OP`` names it on the wire."""

    OP: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        d = {"op": self.OP}
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            d[f.name] = v.wire if isinstance(v, StopReason) else v.value if isinstance(v, Enum) else v
        return d

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Message:  # pragma: no cover - every subclass overrides
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Hello(Message):
    OP: ClassVar[str] = "hello"
    rank: int
    local_rank: int
    pid: int

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Hello:
        return cls(rank=_int("rank", d.get("rank"), minimum=-1), local_rank=_int("local_rank", d.get("local_rank"), minimum=0),
                   pid=_int("pid", d.get("pid"), minimum=1))


@dataclass(frozen=True, slots=True)
class Stop(Message):
    OP: ClassVar[str] = "stop"
    reason: StopReason
    deadline: float | None = None
    """Epoch seconds by which a draining node must be gone (None for a resize)."""
    why: str = ""

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Stop:
        return cls(reason=StopReason.from_wire(d.get("reason", "")),
                   deadline=_finite("deadline", d.get("deadline"), positive=True, optional=True),
                   why=_str("why", d.get("why", "")))


@dataclass(frozen=True, slots=True)
class CheckpointNow(Message):
    """agent -> worker: take one out-of-cycle checkpoint at the next step boundary and keep training."""

    OP: ClassVar[str] = "checkpoint"
    why: str = ""

    @classmethod
    def parse(cls, d: dict[str, Any]) -> CheckpointNow:
        return cls(why=_str("why", d.get("why", "")))


@dataclass(frozen=True, slots=True)
class Restored(Message):
    """worker -> agent: the worker group restored checkpoint ``step`` (work past it is recomputed)."""

    OP: ClassVar[str] = "restored"
    step: int
    rank: int
    kind: CheckpointKind | None = None
    """Kind of the restored checkpoint (None when it did not say)."""

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Restored:
        kind = d.get("kind")
        try:
            k = None if kind is None else CheckpointKind(kind)
        except ValueError:
            raise ProtocolError(f"`kind` must be one of {[k.value for k in CheckpointKind]}, got {kind!r}") from None
        return cls(step=_int("step", d.get("step"), minimum=0), rank=_int("rank", d.get("rank"), minimum=0), kind=k)


@dataclass(frozen=True, slots=True)
class Parked(Message):
    """worker -> agent: this worker is alive at step ``step``, has torn its process groups down and
    waits for a :class:`Reform` (or, ``reason`` standby, is warmed up for its first world)."""

    OP: ClassVar[str] = "parked"
    rank: int
    local_rank: int
    step: int
    reason: ParkReason
    """The rank is the old world's (-1 for a standby worker)."""

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Parked:
        return cls(rank=_int("rank", d.get("rank"), minimum=-1), local_rank=_int("local_rank", d.get("local_rank"), minimum=0),
                   step=_int("step", d.get("step"), minimum=0), reason=_enum("reason", ParkReason, d.get("reason")))


@dataclass(frozen=True, slots=True)
class Joined(Message):
    """worker -> agent: this worker is in the world of round ``round`` (its process group exists). From
    its :class:`Parked` report until this one it is between worlds (finishing a save, waiting for or in
    the arrival count), never inside a collective: a member lost meanwhile is no reason to kill it."""

    OP: ClassVar[str] = "joined"
    rank: int
    local_rank: int
    round: int

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Joined:
        return cls(rank=_int("rank", d.get("rank"), minimum=0), local_rank=_int("local_rank", d.get("local_rank"), minimum=0),
                   round=_int("round", d.get("round"), minimum=0))


@dataclass(frozen=True, slots=True)
class Reform(Message):
    """agent -> worker: the new world this live worker joins (in place, without a restart)."""

    OP: ClassVar[str] = "reform"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    round: int
    group_rank: int = 0
    nodes: int = 1

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Reform:
        world = _int("world_size", d.get("world_size"), minimum=1)
        rank = _int("rank", d.get("rank"), minimum=0)
        if rank >= world:  # type: ignore[operator]
            raise ProtocolError(f"`rank` {rank} is not below `world_size` {world}")
        return cls(rank=rank, world_size=world, local_rank=_int("local_rank", d.get("local_rank"), minimum=0),
                   local_world_size=_int("local_world_size", d.get("local_world_size"), minimum=1),
                   master_addr=_str("master_addr", d.get("master_addr", "")),
                   master_port=_int("master_port", d.get("master_port"), minimum=1),
                   round=_int("round", d.get("round"), minimum=0),
                   group_rank=_int("group_rank", d.get("group_rank", 0), minimum=0),
                   nodes=_int("nodes", d.get("nodes", 1), minimum=1))


@dataclass(frozen=True, slots=True)
class Committed(Message):
    OP: ClassVar[str] = "committed"
    step: int
    kind: CheckpointKind
    rank: int
    saved: bool = True
    """False when the checkpoint could not be saved (no checkpoint URL, or the save failed)."""
    seconds: float = 0.0
    nbytes: int = 0
    stage_s: float = 0.0
    persist_s: float = 0.0
    last_committed: int | None = None
    """The newest committed step (the one a restore will use), for the lost-work log line."""
    error: str = ""
    """Why the save failed (the storage error, or the missed deadline); empty when it was saved, or
    not attempted because ``checkpoint.url`` is unset."""

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Committed:
        try:
            kind = CheckpointKind(d.get("kind"))
        except ValueError:
            raise ProtocolError(f"`kind` must be one of {[k.value for k in CheckpointKind]}, got {d.get('kind')!r}") from None
        saved = d.get("saved", True)
        if not isinstance(saved, bool):
            raise ProtocolError(f"`saved` must be true or false, got {saved!r}")
        return cls(step=_int("step", d.get("step"), minimum=0), kind=kind, rank=_int("rank", d.get("rank"), minimum=0),
                   saved=saved, seconds=_finite("seconds", d.get("seconds", 0.0)),
                   nbytes=_int("nbytes", d.get("nbytes", 0), minimum=0),
                   stage_s=_finite("stage_s", d.get("stage_s", 0.0)), persist_s=_finite("persist_s", d.get("persist_s", 0.0)),
                   last_committed=_int("last_committed", d.get("last_committed"), minimum=0, optional=True),
                   error=_str("error", d.get("error", ""), limit=500))


@dataclass(frozen=True, slots=True)
class Progress(Message):
    """worker -> agent, every ``hang.heartbeat_interval_s`` from a daemon thread of the worker (a frozen
    or SIGSTOPped process sends none): where the worker is. ``beat`` counts the heartbeats; ``progress``
    counts the heartbeats at which the worker moved on (its step or phase changed, or its main thread
    ran Python: the frame it executes changed), so a rank blocked in a collective beats without
    progressing. ``where`` is the main thread's innermost Python frame (``file:line function``)."""

    OP: ClassVar[str] = "progress"
    rank: int
    local_rank: int
    step: int
    phase: Phase
    beat: int
    progress: int
    where: str = ""

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Progress:
        return cls(rank=_int("rank", d.get("rank"), minimum=-1), local_rank=_int("local_rank", d.get("local_rank"), minimum=0),
                   step=_int("step", d.get("step"), minimum=0), phase=_enum("phase", Phase, d.get("phase")), beat=_int("beat", d.get("beat"), minimum=0),
                   progress=_int("progress", d.get("progress"), minimum=0), where=_str("where", d.get("where", "")))


@dataclass(frozen=True, slots=True)
class Abort(Message):
    """agent -> worker: end this world's collectives now (a peer is hung or frozen: its sockets stay
    open, so nothing fails by itself before the process-group timeout). The worker's blocked
    collective fails, it parks (``peer_lost``) and re-forms in place around the culprit."""

    OP: ClassVar[str] = "abort"
    why: str = ""

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Abort:
        return cls(why=_str("why", d.get("why", "")))


STACK_DUMP_SIGNAL = signal.SIGUSR2
"""The signal a worker answers with a dump of every thread's Python stack on its stderr (faulthandler,
installed by the runtime); the agent sends it to a hung rank before ending it, to log where it is. A
SIGSTOPped process cannot run it: then the last ``where`` of its heartbeats is all there is."""


@dataclass(frozen=True, slots=True)
class Pace(Message):
    """worker -> agent: this rank's local compute time of its recent steps (seconds each: step start to
    arrival at the step boundary, minus the time blocked in the gradient synchronisation and in
    ``rt.all_reduce``), sent at step agreements, at most :data:`MAX_PACE` values per message. The agent
    keeps a window of them per local rank (:mod:`trainguard.agent.straggler`)."""

    OP: ClassVar[str] = "pace"
    rank: int
    local_rank: int
    step: int
    """The step of the last value."""
    compute_s: tuple[float, ...] = ()

    MAX_PACE: ClassVar[int] = 64

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Pace:
        raw = d.get("compute_s", [])
        if not isinstance(raw, list) or len(raw) > cls.MAX_PACE:
            raise ProtocolError(f"`compute_s` must be a list of at most {cls.MAX_PACE} numbers, got {raw!r}"[:300])
        values = tuple(_finite("compute_s", v) for v in raw)
        if any(v < 0 for v in values):  # type: ignore[operator]
            raise ProtocolError(f"`compute_s` must hold no negative value, got {raw!r}"[:300])
        return cls(rank=_int("rank", d.get("rank"), minimum=0), local_rank=_int("local_rank", d.get("local_rank"), minimum=0),
                   step=_int("step", d.get("step"), minimum=0), compute_s=values)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class DrainRequest(Message):
    """CLI -> agent: drain this node (``trainguard drain``)."""

    OP: ClassVar[str] = "drain"
    deadline_s: float | None = None
    """Seconds from now; None: the configured ``preemption.default_deadline_s``."""
    reason: str = "trainguard drain"

    MAX_DEADLINE_S: ClassVar[float] = 7 * 24 * 3600.0

    @classmethod
    def parse(cls, d: dict[str, Any]) -> DrainRequest:
        deadline = _finite("deadline_s", d.get("deadline_s"), positive=True, optional=True)
        if deadline is not None and deadline > cls.MAX_DEADLINE_S:
            raise ProtocolError(f"`deadline_s` must be at most {cls.MAX_DEADLINE_S:.0f} (a week), got {deadline!r}")
        return cls(deadline_s=deadline, reason=_str("reason", d.get("reason") or "trainguard drain"))


@dataclass(frozen=True, slots=True)
class StatusRequest(Message):
    """CLI -> agent: the node's live state."""

    OP: ClassVar[str] = "status"

    @classmethod
    def parse(cls, d: dict[str, Any]) -> StatusRequest:
        return cls()


@dataclass(frozen=True, slots=True)
class Reply(Message):
    """agent -> CLI: the answer to one request. ``data`` carries the request's result."""

    OP: ClassVar[str] = "reply"
    ok: bool
    error: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Reply:
        ok = d.get("ok")
        if not isinstance(ok, bool):
            raise ProtocolError(f"`ok` must be true or false, got {ok!r}")
        data = d.get("data", {})
        if not isinstance(data, dict):
            raise ProtocolError(f"`data` must be an object, got {data!r}")
        return cls(ok=ok, error=_str("error", d.get("error", ""), limit=2000), data=data)


MESSAGES: dict[str, type[Message]] = {m.OP: m for m in (Hello, Stop, CheckpointNow, Parked, Joined, Reform, Committed, Restored,
                                                         Progress, Abort, Pace, DrainRequest, StatusRequest, Reply)}
MAX_LINE = 64 * 1024
"""Longest accepted line (bytes); a longer one is a :class:`ProtocolError`."""


def encode(msg: Message) -> bytes:
    """One line of JSON, newline-terminated."""
    return (json.dumps(msg.to_dict(), allow_nan=False) + "\n").encode()


def decode(line: bytes | str) -> Message:
    """Parse and validate one line; :class:`ProtocolError` says what is wrong."""
    if len(line) > MAX_LINE:
        raise ProtocolError(f"message longer than {MAX_LINE} bytes")
    try:
        d = json.loads(line)
    except ValueError as e:
        raise ProtocolError(f"not JSON: {e}") from None
    if not isinstance(d, dict):
        raise ProtocolError("a message must be a JSON object")
    op = d.get("op")
    cls = MESSAGES.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(f"unknown op {op!r} (expected one of {sorted(MESSAGES)})")
    return cls.parse(d)


__all__ = [
    "EXIT_RESIZE", "EXIT_SUCCESS", "MESSAGES", "STACK_DUMP_SIGNAL", "Abort", "AgentState", "EvictionCause", "Phase", "Progress", "CheckpointKind", "CheckpointNow", "Committed",
    "DrainRequest", "Joined", "ParkReason", "Parked", "Reform", "Restored",
    "ExitKind", "Hello", "Message", "NoticeSource", "Pace", "ProtocolError", "Reply", "RuntimeEnv", "StatusRequest",
    "Stop", "StopReason", "WorkerStatus", "classify_exit", "control_socket_path", "decode", "encode",
]
