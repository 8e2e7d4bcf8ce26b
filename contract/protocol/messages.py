"""The control messages over the agent's Unix socket and their line-JSON codec (:func:`encode`,
:func:`decode`), validated on decode. A part of :mod:`trainguard.contract.protocol` (its docstring lists
who sends which message)."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar

from trainguard.contract.protocol.fields import ProtocolError, _enum, _finite, _int, _str
from trainguard.contract.protocol.values import CheckpointKind, ParkReason, Phase, StopReason

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
    keeps a window of them per local rank (:mod:`trainguard.agent.straggler`). The same report carries what
    the drain lead is sized from (:mod:`trainguard.agent.lead`): the whole time of the same steps and the
    checkpoints this rank committed since its last report."""

    OP: ClassVar[str] = "pace"
    rank: int
    local_rank: int
    step: int
    """The step of the last value."""
    compute_s: tuple[float, ...] = ()
    step_s: tuple[float, ...] = ()
    """The same steps' whole time, start to arrival at the boundary (waits on the peers included)."""
    checkpoint_s: tuple[float, ...] = ()
    """Stage + persist seconds of each checkpoint this rank committed since its last report (any kind)."""

    MAX_PACE: ClassVar[int] = 64

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Pace:
        return cls(rank=_int("rank", d.get("rank"), minimum=0), local_rank=_int("local_rank", d.get("local_rank"), minimum=0),
                   step=_int("step", d.get("step"), minimum=0), compute_s=cls._seconds(d, "compute_s"),
                   step_s=cls._seconds(d, "step_s"), checkpoint_s=cls._seconds(d, "checkpoint_s"))

    @classmethod
    def _seconds(cls, d: dict[str, Any], name: str) -> tuple[float, ...]:
        raw = d.get(name, [])
        if not isinstance(raw, list) or len(raw) > cls.MAX_PACE:
            raise ProtocolError(f"`{name}` must be a list of at most {cls.MAX_PACE} numbers, got {raw!r}"[:300])
        values = tuple(_finite(name, v) for v in raw)
        if any(v < 0 for v in values):  # type: ignore[operator]
            raise ProtocolError(f"`{name}` must hold no negative value, got {raw!r}"[:300])
        return values  # type: ignore[return-value]


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
