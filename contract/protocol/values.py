"""The values that cross a process or module boundary (:class:`AgentState`, :class:`StopReason`,
:class:`CheckpointKind`, :class:`ParkReason`, :class:`Phase`, :class:`NoticeSource`, ...; metric labels
derive from them) and the exit-code contract (:data:`EXIT_RESIZE`, :func:`classify_exit`). A part of
:mod:`trainguard.contract.protocol`."""

from __future__ import annotations

import signal
from enum import Enum, IntEnum

from trainguard.contract.protocol.fields import ProtocolError

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
    FINISHED = "finished"
    """Training is over (``Runtime.finish``): the final save is committed and the rank tears down and exits.
    Its last beat says so before its beats stop; the agent never names it hung for its silence (the
    interpreter's exit took over 6 s on a loaded machine), and its process exit is the agent's to watch."""


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
