"""trainguard.agent.watchers: preemption notice sources.

Owner's entry points::

    watchers = build_watchers(cfg.preemption)         # probes the cloud when sources has "auto"
    start_all(watchers, on_notice)                     # main thread (signal handlers)
    manual_watcher(watchers).trigger(30.0, "cli")      # from the control socket
    acknowledge(watchers, notice)                      # after the emergency checkpoint commits
    stop_all(watchers, timeout=5.0)                    # main thread

See :mod:`.base` for the :class:`Notice` fields and the threading contract.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainguard.agent.watchers.auto import auto_watchers, cloud_watchers, detect_cloud
from trainguard.agent.watchers.aws import AwsWatcher
from trainguard.agent.watchers.azure import AzureWatcher
from trainguard.agent.watchers.base import KIND_PRIORITY, MetadataError, Notice, Watcher, WatcherError, most_urgent
from trainguard.agent.watchers.config import PreemptionConfig
from trainguard.agent.watchers.gcp import GcpWatcher
from trainguard.agent.watchers.manual import ManualWatcher
from trainguard.agent.watchers.signals import SignalWatcher
from trainguard.contract.log import get_logger

__all__ = [
    "KIND_PRIORITY", "AwsWatcher", "AzureWatcher", "GcpWatcher", "ManualWatcher", "MetadataError", "Notice",
    "PreemptionConfig", "SignalWatcher", "Watcher", "WatcherError", "acknowledge", "auto_watchers", "build_watchers",
    "cloud_watchers", "detect_cloud", "manual_watcher", "most_urgent", "start_all", "stop_all",
]

log = get_logger("trainguard.watchers")


def build_watchers(cfg: PreemptionConfig, **kw: Any) -> list[Watcher]:
    """The watchers ``cfg.sources`` asks for, not started, plus one :class:`ManualWatcher`.

    ``auto`` probes the cloud (blocks up to ~``probe_timeout_s``); when no cloud answers, a
    :class:`SignalWatcher` is included even if ``signal`` is not listed, so the agent still
    drains on ``systemctl stop``. ``none`` yields only the manual watcher. ``kw`` (e.g. ``clock``)
    is passed to every watcher.
    """
    out: list[Watcher] = []
    clouds: list[str] = []
    want_signal = "signal" in cfg.sources
    for src in dict.fromkeys(cfg.sources):  # ordered, de-duplicated
        if src == "auto":
            found = detect_cloud(cfg)
            if found is None:
                want_signal = True
            elif found not in clouds:
                clouds.append(found)
        elif src in ("aws", "gcp", "azure") and src not in clouds:
            clouds.append(src)
    for cloud in clouds:
        out.extend(cloud_watchers(cfg, cloud, **kw))
    if want_signal:
        out.append(SignalWatcher.from_config(cfg, **kw))
    out.append(ManualWatcher.from_config(cfg, **kw))
    log.info("preemption_watchers", watchers=[w.name for w in out], sources=list(cfg.sources))
    return out


def start_all(watchers: list[Watcher], on_notice: Callable[[Notice], None]) -> None:
    """Start every watcher (from the main thread); on failure stop those already started and re-raise."""
    started: list[Watcher] = []
    try:
        for w in watchers:
            w.start(on_notice)
            started.append(w)
    except BaseException:
        stop_all(started)
        raise


def stop_all(watchers: list[Watcher], timeout: float = 5.0) -> bool:
    """Stop every watcher, in parallel as far as aborting requests goes; True if all threads ended."""
    for w in watchers:
        w.request_stop()  # everyone first, so the joins below do not add up
    return all([w.stop(timeout) for w in watchers])


def manual_watcher(watchers: list[Watcher]) -> ManualWatcher:
    """The manual-drain watcher in ``watchers`` (``build_watchers`` always adds one)."""
    for w in watchers:
        if isinstance(w, ManualWatcher):
            return w
    raise LookupError("no ManualWatcher in the list; build it with build_watchers()")


def acknowledge(watchers: list[Watcher], notice: Notice) -> bool:
    """Acknowledge ``notice`` at its source (Azure StartRequests); False where there is nothing to do."""
    return any([w.acknowledge(notice) for w in watchers if w.source == notice.source])
