"""The environment contract: :class:`RuntimeEnv`, which the agent writes for every worker
(:meth:`RuntimeEnv.to_env`) and the worker reads (:meth:`RuntimeEnv.from_env`), the only reader and writer
of ``TRAINGUARD_RT_*`` variables; and where the control socket lives (:func:`control_socket_path`). A part
of :mod:`trainguard.contract.protocol`."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from trainguard.contract.protocol.fields import ProtocolError


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
