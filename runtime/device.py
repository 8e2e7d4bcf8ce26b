"""The worker's device: chosen once by the runtime, from ``LOCAL_RANK``, and named everywhere.

Why the runtime owns it (and nothing guesses it from where a model sits): torch resolves "the GPU" of
an un-named call to ``torch.cuda.current_device()``, which is device 0 until ``set_device`` runs. On an
8-GPU node without :func:`bind` every rank's FSDP2 shards land on cuda:0, a ``torch.cuda.synchronize()``
waits on cuda:0 while the rank's copies ran on cuda:k, and ``dist.barrier()`` picks device 0 ("may
hang"). So the runtime

1. selects ``cuda:<LOCAL_RANK>`` when CUDA is available, else the CPU (:func:`select_device`);
2. makes it current (:func:`bind`: ``torch.cuda.set_device``) *before* ``init_process_group``;
3. passes it as ``device_id`` with the configured timeout (:func:`init_kwargs`), which binds the
   default group to it (eager NCCL communicator; ``barrier`` and every sub-group use it);
4. hands it to the strategy (``Strategy.device``), the metrics (GPU label, allocator peak) and the
   step timer (:class:`StepTimer`).

torch's CUDA entry points are looked up at call time (``torch.cuda.set_device`` ...), so tests patch
them on CPU. Nothing here has run on a GPU yet; see docs/gpu.md for what is verified and what is not.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch


class DeviceError(RuntimeError):
    """The worker cannot use the device its ``LOCAL_RANK`` names; the message says why and the fix."""


def select_device(local_rank: int) -> torch.device:
    """``cuda:<local_rank>`` when CUDA is available, else ``cpu``.

    ``LOCAL_RANK`` indexes the GPUs this process sees (``CUDA_VISIBLE_DEVICES`` applies first), one
    worker per GPU, as torchrun assumes. Raises :class:`DeviceError` when there are fewer."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if not 0 <= local_rank < count:
        raise DeviceError(f"LOCAL_RANK={local_rank} but this process sees {count} GPU(s). Fix: run at most one worker "
                          f"per GPU (workers.nproc_per_node / --nproc-per-node <= {count}), or widen "
                          f"CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    """The default process group's backend for ``device``: NCCL on CUDA, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def bind(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device (a no-op on CPU). Call before
    ``init_process_group`` and before building anything on the GPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def init_kwargs(device: torch.device, timeout_s: float) -> dict[str, Any]:
    """Keyword arguments of ``init_process_group`` for ``device``: ``device_id`` on CUDA (binds the
    default group to it: eager communicator, barriers and sub-groups on that device) and ``timeout``
    when one is configured (``workers.pg_timeout_s``; 0 keeps torch's default)."""
    kw: dict[str, Any] = {}
    if device.type == "cuda":
        kw["device_id"] = device
    if timeout_s > 0:
        kw["timeout"] = timedelta(seconds=timeout_s)
    return kw


def barrier_kwargs(device: torch.device) -> dict[str, Any]:
    """``dist.barrier`` arguments that name the device (torch otherwise falls back to device 0)."""
    return {"device_ids": [device.index]} if device.type == "cuda" else {}


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on CPU). Named, never the current device."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_label(device: torch.device) -> str | None:
    """A stable name of the GPU behind ``device``: its UUID as NVML writes it (``GPU-<uuid>``), the
    label of every GPU series on both the agent's NVML side and the worker's allocator side (indices
    diverge under ``CUDA_VISIBLE_DEVICES`` or CUDA's default FASTEST_FIRST order). None on CPU, or
    when the driver does not say."""
    if device.type != "cuda":
        return None
    try:
        raw = str(torch.cuda.get_device_properties(device).uuid)
    except Exception:  # an old driver, an emulator: the series are then labelled by index
        return f"cuda:{device.index}"
    return normalise_uuid(raw)


def normalise_uuid(raw: str | bytes) -> str:
    """``GPU-<uuid>`` (NVML's form) from what torch or NVML return (bytes, with or without the prefix)."""
    s = raw.decode() if isinstance(raw, bytes) else str(raw)
    s = s.strip().strip("\0")
    return s if s.startswith(("GPU-", "MIG-")) else f"GPU-{s}"


class StepTimer:
    """Time of each training step, measured where the step runs.

    CPU: the host clock between consecutive step boundaries. CUDA: the host runs ahead of the GPU, so
    host time says when work was *queued*; instead an event is recorded on the device's current
    stream at each boundary and a step's time is the elapsed time between its two events. They are
    read without synchronising: :meth:`lap` returns the steps whose end event has completed (usually
    the previous one), oldest first; at most ``max_pending`` steps wait, beyond that the oldest is
    waited for. ``event_factory`` and ``stream_of`` are injected by tests (fake CUDA on CPU).
    """

    def __init__(self, device: torch.device, *, clock: Callable[[], float] = time.monotonic,
                 event_factory: Callable[[], Any] | None = None, stream_of: Callable[[torch.device], Any] | None = None,
                 max_pending: int = 4) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._clock = clock
        self._event = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self._stream_of = stream_of or torch.cuda.current_stream
        self._max_pending = max_pending
        self._last: Any = None
        self._pending: deque[tuple[Any, Any]] = deque()

    def _mark(self) -> Any:
        if not self.cuda:
            return self._clock()
        ev = self._event()
        ev.record(self._stream_of(self.device))
        return ev

    def start(self) -> None:
        """A boundary that ends no step (after setup, a restore, a re-formation): the next step starts here.
        Steps still pending are dropped."""
        self._pending.clear()
        self._last = self._mark()

    def lap(self) -> list[float]:
        """A step boundary: returns the seconds of every step whose time is known now (see the class)."""
        now = self._mark()
        if self._last is None:
            self._last = now
            return []
        if not self.cuda:
            seconds, self._last = now - self._last, now
            return [max(0.0, seconds)]
        self._pending.append((self._last, now))
        self._last = now
        out: list[float] = []
        while self._pending and (len(self._pending) > self._max_pending or self._pending[0][1].query()):
            start, end = self._pending.popleft()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1000.0)
        return out

    def completed(self, timeout_s: float, *, poll_s: float = 0.01, sleep: Callable[[float], None] = time.sleep) -> bool:
        """Whether the GPU has finished everything queued up to the last boundary, polled for at most
        ``timeout_s`` (never a blocking wait: the stream may hold a kernel that waits for a lost peer).
        On NCCL the host runs ahead: a step's optimizer update is *queued* when the step boundary passes,
        and after an abort it may run on half-reduced gradients. Always True on the CPU."""
        if not self.cuda or self._last is None:
            return True
        deadline = self._clock() + timeout_s
        while not self._last.query():
            if self._clock() >= deadline:
                return False
            sleep(poll_s)
        return True


__all__ = ["DeviceError", "StepTimer", "backend_for", "barrier_kwargs", "bind", "gpu_label", "init_kwargs",
           "normalise_uuid", "select_device", "synchronize"]
