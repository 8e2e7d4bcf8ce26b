"""Node health from NVML (issue 38): a sick GPU drains its node; a broken node never enters a world.

Three parts, each small:

* :class:`GpuProbe` (the interface) reads one :class:`GpuSample` per GPU: the XID errors seen since the
  last read, volatile double-bit (uncorrectable) ECC errors, retired pages pending, row remapping
  pending / failed, the clock-throttle reasons, and the PCIe link width against its maximum.
  :class:`NvmlProbe` reads them through ``pynvml`` (``nvidia-ml-py``; the module is injectable, so the
  tests run it on CPU against a fake NVML); :class:`FileProbe` reads them from a JSON file that a test or
  the bench rewrites (``health.probe_file``: fault injection from outside the job).
* :func:`classify` (pure, table-tested in ``tests/agent/test_health.py``) says what a sample means:
  ``fatal`` (an XID of :data:`FATAL_XIDS`, a double-bit ECC error, a pending page retirement or row
  remap, a failed remap: the GPU needs a reset or a replacement, and a job on it computes garbage or
  dies), ``degraded`` (thermal or power throttling, a PCIe link narrower than its maximum: slower, not
  wrong; reported, and the straggler detector decides whether the job is faster without it) or ``ok``.
* :class:`HealthMonitor` polls every ``health.interval_s`` on a daemon thread, exports the state per GPU,
  logs one ``gpu_health_changed`` line per change and, on ``fatal``, drains the node through the normal
  drain path (source ``health``: emergency checkpoint, the survivors re-form in place).
  :func:`preflight` runs the same check once before the agent enters a rendezvous: a fatal GPU stops the
  start with a :class:`~trainguard.contract.configbase.ConfigError` naming the GPU and the reason.

Without ``pynvml``, a driver or a GPU (every CPU node) the probe is unavailable: one
``gpu_health_unavailable`` line, nothing is checked, nothing is exported.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from trainguard.contract.configbase import ConfigError, require
from trainguard.contract.log import get_logger

log = get_logger("trainguard.agent.health")

FATAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 123, 140})
"""XIDs after which the GPU is not to be trusted until it is reset: 48 double-bit ECC, 63/64 row-remap
event/failure, 74 NVLink error, 79 fallen off the bus, 92 high single-bit ECC rate, 94/95 contained /
uncontained ECC error, 119/120 GSP errors, 123 SPI PMU error, 140 unrecovered ECC error (NVIDIA's XID
catalogue: "Xid errors", the ones whose action is a GPU reset or a node drain)."""

THROTTLE_SW_POWER_CAP = 0x4
THROTTLE_HW_SLOWDOWN = 0x8
THROTTLE_SW_THERMAL = 0x20
THROTTLE_HW_THERMAL = 0x40
THROTTLE_HW_POWER_BRAKE = 0x80
DEGRADING_THROTTLES = {THROTTLE_HW_SLOWDOWN: "hw_slowdown", THROTTLE_SW_THERMAL: "sw_thermal",
                       THROTTLE_HW_THERMAL: "hw_thermal", THROTTLE_HW_POWER_BRAKE: "hw_power_brake",
                       THROTTLE_SW_POWER_CAP: "sw_power_cap"}
"""``nvmlClocksEventReason*`` bits that mean the GPU runs below its clocks (idle and application-clock
settings are not among them)."""


class GpuHealth(str, Enum):
    """Health of one GPU; metric labels derive from it (``trainguard_gpu_health_state``)."""

    OK = "ok"
    DEGRADED = "degraded"
    FATAL = "fatal"


@dataclass(frozen=True, slots=True)
class GpuSample:
    index: int
    xids: tuple[int, ...] = ()
    """XID errors seen since the previous sample."""
    dbe_volatile: int = 0
    """Uncorrectable (double-bit) ECC errors since the driver loaded."""
    retired_pending: bool = False
    remap_pending: bool = False
    remap_failed: bool = False
    throttle_reasons: int = 0
    pcie_width: int = 0
    pcie_max_width: int = 0
    uuid: str = ""

    @property
    def label(self) -> str:
        return self.uuid or str(self.index)


@dataclass(frozen=True, slots=True)
class HealthVerdict:
    state: GpuHealth
    reasons: tuple[str, ...] = ()


def classify(s: GpuSample, *, throttle_is_degraded: bool = True) -> HealthVerdict:
    """Pure: what sample ``s`` says about its GPU (see the module docstring)."""
    fatal = [f"xid_{x}" for x in sorted(set(s.xids)) if x in FATAL_XIDS]
    if s.dbe_volatile > 0:
        fatal.append("ecc_double_bit")
    if s.retired_pending:
        fatal.append("retired_pages_pending")
    if s.remap_pending:
        fatal.append("row_remap_pending")
    if s.remap_failed:
        fatal.append("row_remap_failed")
    if fatal:
        return HealthVerdict(GpuHealth.FATAL, tuple(fatal))
    degraded = [name for bit, name in DEGRADING_THROTTLES.items() if s.throttle_reasons & bit] if throttle_is_degraded else []
    if s.pcie_max_width and 0 < s.pcie_width < s.pcie_max_width:
        degraded.append(f"pcie_x{s.pcie_width}_of_x{s.pcie_max_width}")
    if degraded:
        return HealthVerdict(GpuHealth.DEGRADED, tuple(degraded))
    return HealthVerdict(GpuHealth.OK)


@dataclass(kw_only=True, slots=True)
class HealthConfig:
    enabled: bool = True
    """Check the node's GPUs through NVML before joining and while training (CPU nodes: nothing to check)."""

    interval_s: float = 10.0
    """How often the GPUs are read while training."""

    on_fatal: str = "drain"
    """``drain`` (a fatal GPU drains the node through the normal path) or ``report`` (log and export only)."""

    throttle_is_degraded: bool = True
    """Count thermal / power throttling as ``degraded`` (reported; never drains by itself)."""

    probe_file: str = ""
    """Tests and benches only: read the GPU samples from this JSON file instead of NVML (a list of objects
    with the :class:`GpuSample` fields)."""

    def __post_init__(self) -> None:
        require(0.1 <= self.interval_s <= 3600, "interval_s", f"must be within 0.1..3600 s, got {self.interval_s}", "e.g. 10")
        require(self.on_fatal in ("drain", "report"), "on_fatal", f"must be drain or report, got {self.on_fatal!r}",
                "use 'drain' (default) or 'report'")


class GpuProbe(Protocol):
    """Reads every GPU of the node (empty: none, or the probe is unavailable)."""

    reason: str
    """Why the probe reads nothing (empty when it works)."""

    def read(self) -> list[GpuSample]: ...

    def close(self) -> None: ...


class NvmlProbe:
    """:class:`GpuProbe` over ``pynvml``. ``nvml``: a module with its API (tests pass a fake)."""

    def __init__(self, nvml: Any | None = None) -> None:
        self.reason = ""
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._events: Any = None
        try:
            if nvml is None:
                import pynvml as nvml  # type: ignore[no-redef]
            nvml.nvmlInit()
            n = nvml.nvmlDeviceGetCount()
            if n == 0:
                self.reason = "NVML sees no GPU"
                nvml.nvmlShutdown()
                return
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
            self._nvml = nvml
        except Exception as e:  # noqa: BLE001 - no driver, no library: nothing to check
            self.reason = f"NVML unavailable: {type(e).__name__}: {e}"[:300]
            return
        try:  # XIDs arrive as events
            self._events = nvml.nvmlEventSetCreate()
            for h in self._handles:
                nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, self._events)
        except Exception as e:  # noqa: BLE001 - e.g. not supported on this board: the rest is still read
            self._events = None
            log.info("gpu_xid_events_unavailable", error=f"{type(e).__name__}: {e}"[:200])

    def _xids(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        if self._events is None:
            return out
        nv = self._nvml
        for _ in range(64):  # drain what is queued, never block
            try:
                ev = nv.nvmlEventSetWait(self._events, 0)
            except Exception:  # noqa: BLE001 - NVML_ERROR_TIMEOUT: nothing queued
                break
            try:
                idx = self._handles.index(ev.device)
            except ValueError:
                idx = -1
            out.setdefault(idx, []).append(int(ev.eventData))
        return out

    def read(self) -> list[GpuSample]:
        if self._nvml is None:
            return []
        nv = self._nvml
        xids = self._xids()
        out = []
        for i, h in enumerate(self._handles):
            def q(fn: Callable[[], Any], default: Any) -> Any:
                try:
                    return fn()
                except Exception:  # noqa: BLE001 - a query a board does not support reads as healthy
                    return default
            dbe = q(lambda: nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC), 0)
            retired = q(lambda: nv.nvmlDeviceGetRetiredPagesPendingStatus(h), 0)
            remap = q(lambda: nv.nvmlDeviceGetRemappedRows(h), (0, 0, 0, 0))
            reasons = q(lambda: nv.nvmlDeviceGetCurrentClocksEventReasons(h), None)
            if reasons is None:
                reasons = q(lambda: nv.nvmlDeviceGetCurrentClocksThrottleReasons(h), 0)
            width = q(lambda: nv.nvmlDeviceGetCurrPcieLinkWidth(h), 0)
            max_width = q(lambda: nv.nvmlDeviceGetMaxPcieLinkWidth(h), 0)
            uuid = q(lambda: nv.nvmlDeviceGetUUID(h), "")
            out.append(GpuSample(index=i, xids=tuple(xids.get(i, ())), dbe_volatile=int(dbe), retired_pending=bool(retired),
                                 remap_pending=bool(remap[2]), remap_failed=bool(remap[3]), throttle_reasons=int(reasons),
                                 pcie_width=int(width), pcie_max_width=int(max_width),
                                 uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid)))
        return out

    def close(self) -> None:
        if self._nvml is not None:
            try:
                if self._events is not None:
                    self._nvml.nvmlEventSetFree(self._events)
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
            self._nvml = None


class FileProbe:
    """:class:`GpuProbe` reading a JSON list of :class:`GpuSample` fields from ``path`` at each read (a
    missing or malformed file reads as no GPU). For tests and the bench."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.reason = ""

    def read(self) -> list[GpuSample]:
        try:
            with open(self.path) as f:
                raw = json.load(f)
            return [GpuSample(**{**d, "xids": tuple(d.get("xids", ()))}) for d in raw]
        except (OSError, ValueError, TypeError):
            return []

    def close(self) -> None:
        pass


def build_probe(cfg: HealthConfig, nvml: Any | None = None) -> GpuProbe:
    return FileProbe(cfg.probe_file) if cfg.probe_file else NvmlProbe(nvml)


def check(samples: Sequence[GpuSample], cfg: HealthConfig) -> dict[str, HealthVerdict]:
    """Pure: every GPU's verdict by its label."""
    return {s.label: classify(s, throttle_is_degraded=cfg.throttle_is_degraded) for s in samples}


def preflight(probe: GpuProbe, cfg: HealthConfig) -> dict[str, HealthVerdict]:
    """Before the node enters a world: raise :class:`ConfigError` when a GPU is fatal (the node would
    fail the job or compute garbage); return the verdicts otherwise (a degraded GPU is logged)."""
    verdicts = check(probe.read(), cfg)
    bad = {g: v for g, v in verdicts.items() if v.state is GpuHealth.FATAL}
    for g, v in verdicts.items():
        if v.state is GpuHealth.DEGRADED:
            log.warning("gpu_health_degraded", gpu=g, reasons=list(v.reasons), effect="the node joins; it may be slow")
    if bad and cfg.on_fatal == "drain":
        what = "; ".join(f"GPU {g}: {', '.join(v.reasons)}" for g, v in sorted(bad.items()))
        raise ConfigError("health.enabled", f"a GPU of this node is not healthy ({what})",
                          "reset or replace the GPU (nvidia-smi -r, or drain the host); to start anyway set "
                          "health.on_fatal: report", value=None)
    return verdicts


@dataclass
class HealthMonitor:
    """Polls ``probe`` every ``cfg.interval_s`` on a daemon thread; ``drain(reason)`` on a fatal GPU
    (once), ``observer``: the agent metrics' straggler part (``set_gpu_health``), or None."""

    probe: GpuProbe
    cfg: HealthConfig
    drain: Callable[[str], Any]
    observer: Any = None
    states: dict[str, HealthVerdict] = field(default_factory=dict)
    _drained: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def poll(self) -> dict[str, HealthVerdict]:
        """One read: log changes, export, drain on a fatal GPU. Returns the verdicts."""
        verdicts = check(self.probe.read(), self.cfg)
        for g, v in verdicts.items():
            before = self.states.get(g)
            if before is None or before.state is not v.state or before.reasons != v.reasons:
                (log.error if v.state is GpuHealth.FATAL else log.warning if v.state is GpuHealth.DEGRADED else log.info)(
                    "gpu_health_changed", gpu=g, state=v.state.value, reasons=list(v.reasons),
                    before=None if before is None else before.state.value)
        self.states.update(verdicts)
        if self.observer is not None:
            try:
                for g, v in verdicts.items():
                    self.observer.set_gpu_health(g, v.state.value)
            except Exception as e:  # noqa: BLE001 - observing only
                log.warning("observer_failed", method="set_gpu_health", error=str(e))
        fatal = {g: v for g, v in verdicts.items() if v.state is GpuHealth.FATAL}
        if fatal and not self._drained and self.cfg.on_fatal == "drain":
            self._drained = True
            reason = "; ".join(f"GPU {g}: {', '.join(v.reasons)}" for g, v in sorted(fatal.items()))
            log.error("gpu_health_drain", reason=reason, effect="draining this node: emergency checkpoint, the survivors "
                                                               "re-form in place")
            if self.observer is not None:
                self.observer.evicted("gpu_health")
            self.drain(reason)
        return verdicts

    def start(self) -> HealthMonitor:
        def loop() -> None:
            while not self._stop.wait(self.cfg.interval_s):
                try:
                    self.poll()
                except Exception as e:  # noqa: BLE001 - a failed read must not kill the thread
                    log.warning("gpu_health_read_failed", error=f"{type(e).__name__}: {e}"[:300])

        self._thread = threading.Thread(target=loop, name="trainguard-health", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.probe.close()


def open_probe(cfg: HealthConfig, nvml: Any | None = None) -> GpuProbe | None:
    """The pre-flight check at the agent's start, before it enters any rendezvous (raises
    :class:`ConfigError` on a fatal GPU, see :func:`preflight`); returns the probe for the
    :class:`HealthMonitor`, or None when disabled or no GPU can be read (one line says why)."""
    if not cfg.enabled:
        return None
    probe = build_probe(cfg, nvml)
    if probe.reason:
        log.info("gpu_health_unavailable", reason=probe.reason, effect="no GPU health checks on this node")
        probe.close()
        return None
    try:
        verdicts = preflight(probe, cfg)
    except BaseException:
        probe.close()
        raise
    log.info("gpu_health_preflight", gpus=len(verdicts), states={g: v.state.value for g, v in verdicts.items()})
    return probe
