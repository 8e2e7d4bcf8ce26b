"""GPU memory and utilisation through NVML (``nvidia-ml-py``, imported as ``pynvml``).

Read by the agent at scrape time (NVML calls take microseconds), for every GPU NVML sees on the
node: the agent process holds no CUDA context, so this costs the workers nothing. Without
``pynvml``, without a driver, or with zero devices, :class:`GpuSampler` is unavailable, logs ONE
line saying why (``gpu_metrics_unavailable``) and yields nothing: GPU series are then absent,
never zero and never faked.

Threading: :meth:`GpuSampler.read` may be called from several scrape threads; NVML is thread-safe
and the sampler keeps no mutable state except the set of GPUs already reported as failing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from trainguard.contract.log import get_logger

log = get_logger("trainguard.metrics.gpu")


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU at one instant. Bytes are bytes; utilisation is a ratio in 0..1 (``None`` if NVML
    does not report it for this device, e.g. a MIG instance)."""

    index: int
    used_bytes: int
    total_bytes: int
    utilization_ratio: float | None
    uuid: str = ""
    """NVML's ``GPU-<uuid>``; empty when NVML does not say (the series are then labelled by index)."""

    @property
    def label(self) -> str:
        """The ``gpu`` label of this GPU's series: its UUID, the same value the workers' allocator-peak
        series carry (``trainguard.runtime.device.gpu_label``); indices diverge between NVML and CUDA
        under ``CUDA_VISIBLE_DEVICES`` or CUDA's FASTEST_FIRST order."""
        return self.uuid or str(self.index)


class GpuSampler:
    """NVML reader. ``nvml`` injects a module with the ``pynvml`` API (tests pass a fake)."""

    def __init__(self, *, enabled: bool = True, nvml: Any | None = None) -> None:
        self._nvml: Any | None = None
        self._handles: list[Any] = []
        self._uuids: list[str] = []
        self._failed: set[int] = set()
        self._lock = threading.Lock()
        self.reason = ""
        if not enabled:
            self.reason = "disabled by metrics.gpu=false (env TRAINGUARD_METRICS_GPU)"
        else:
            self._init(nvml)
        if self._nvml is None:
            log.info("gpu_metrics_unavailable", reason=self.reason,
                     effect="GPU memory/utilisation series are absent on this node")
        else:
            log.info("gpu_metrics_enabled", gpus=len(self._handles))

    def _init(self, nvml: Any | None) -> None:
        if nvml is None:
            try:
                import pynvml as nvml  # type: ignore[no-redef]
            except ImportError:
                self.reason = "pynvml is not installed (pip install 'trainguard[gpu]' for nvidia-ml-py)"
                return
        try:
            nvml.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.reason = f"NVML init failed: {e!s} (no NVIDIA driver on this node?)"
            return
        try:
            count = int(nvml.nvmlDeviceGetCount())
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as e:
            self.reason = f"NVML device enumeration failed: {e!s}"
            self._shutdown(nvml)
            return
        if not handles:
            self.reason = "NVML sees no GPU on this node"
            self._shutdown(nvml)
            return
        self._nvml, self._handles = nvml, handles
        self._uuids = [self._uuid(nvml, h) for h in handles]

    @staticmethod
    def _uuid(nvml: Any, handle: Any) -> str:
        try:
            raw = nvml.nvmlDeviceGetUUID(handle)
        except Exception:  # an old driver, a fake: labelled by index
            return ""
        s = raw.decode() if isinstance(raw, bytes) else str(raw)
        s = s.strip().strip("\0")
        return s if s.startswith(("GPU-", "MIG-")) else f"GPU-{s}"

    @staticmethod
    def _shutdown(nvml: Any) -> None:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def read(self) -> list[GpuReading]:
        """Current readings; a GPU whose read fails is skipped (logged once per GPU)."""
        nvml = self._nvml
        if nvml is None:
            return []
        out: list[GpuReading] = []
        for i, h in enumerate(self._handles):
            try:
                mem = nvml.nvmlDeviceGetMemoryInfo(h)
            except Exception as e:
                with self._lock:
                    if i not in self._failed:
                        self._failed.add(i)
                        log.warning("gpu_read_failed", gpu=i, error=str(e), effect="series for this GPU absent")
                continue
            util: float | None
            try:
                util = float(nvml.nvmlDeviceGetUtilizationRates(h).gpu) / 100.0
            except Exception:
                util = None
            out.append(GpuReading(i, int(mem.used), int(mem.total), util, self._uuids[i] if i < len(self._uuids) else ""))
        return out

    def close(self) -> None:
        """Release NVML. Idempotent."""
        nvml, self._nvml = self._nvml, None
        if nvml is not None:
            self._shutdown(nvml)
