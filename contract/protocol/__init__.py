"""The worker <-> agent <-> CLI protocol: one package both ends import, as ``trainguard.contract.protocol``
(torchft keeps its whole wire format in one file the same way; here one module per part:
:mod:`~trainguard.contract.protocol.values`, :mod:`~trainguard.contract.protocol.env`,
:mod:`~trainguard.contract.protocol.messages`, :mod:`~trainguard.contract.protocol.fields`).

It holds, and nothing else in trainguard spells them out again:

* :class:`RuntimeEnv` — the environment contract. The agent writes it for every worker with
  :meth:`RuntimeEnv.to_env`; the worker reads it with :meth:`RuntimeEnv.from_env`. This is the only
  reader and writer of the worker's environment variables (those named :data:`RT_PREFIX` ``*``), in
  :mod:`~trainguard.contract.protocol.env`.
* the exit-code contract (:data:`EXIT_RESIZE`, :func:`classify_exit`);
* the value enums that cross a process or module boundary — :class:`AgentState`,
  :class:`StopReason`, :class:`CheckpointKind`, :class:`WorkerStatus`, :class:`NoticeSource` — from
  which metric label values are derived, so they cannot drift;
* the control messages over the agent's Unix socket and their line-JSON codec
  (:func:`encode`, :func:`decode`), validated on decode: a bad message is a :class:`ProtocolError`
  the server answers with ``{"op": "reply", "ok": false, "error": ...}``;
* where the control socket lives (:func:`control_socket_path`).

This is a leaf package: it imports nothing of trainguard and nothing heavier than the standard
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

from trainguard.contract.protocol.env import (
    RT_PREFIX, STEP_AGREEMENT_PERIOD_S, STEP_AGREEMENTS, RuntimeEnv, control_socket_path,
)
from trainguard.contract.protocol.fields import ProtocolError
from trainguard.contract.protocol.messages import (
    MAX_LINE, MESSAGES, STACK_DUMP_SIGNAL, Abort, CheckpointNow, Committed, DrainRequest, Hello, Joined, Message, Pace,
    Parked, Progress, Reform, Reply, Restored, StatusRequest, Stop, decode, encode,
)
from trainguard.contract.protocol.values import (
    EXIT_RESIZE, EXIT_SUCCESS, AgentState, CheckpointKind, CheckpointTier, EvictionCause, ExitKind, NoticeSource,
    ParkReason, Phase, StopReason, WorkerStatus, classify_exit,
)

__all__ = [
    "EXIT_RESIZE", "EXIT_SUCCESS", "MAX_LINE", "MESSAGES", "RT_PREFIX", "STEP_AGREEMENTS", "STEP_AGREEMENT_PERIOD_S", "STACK_DUMP_SIGNAL", "Abort", "AgentState", "EvictionCause", "Phase", "Progress", "CheckpointKind", "CheckpointNow", "CheckpointTier", "Committed",
    "DrainRequest", "Joined", "ParkReason", "Parked", "Reform", "Restored",
    "ExitKind", "Hello", "Message", "NoticeSource", "Pace", "ProtocolError", "Reply", "RuntimeEnv", "StatusRequest",
    "Stop", "StopReason", "WorkerStatus", "classify_exit", "control_socket_path", "decode", "encode",
]
