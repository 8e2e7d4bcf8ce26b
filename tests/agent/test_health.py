"""Node health (agent/health.py): the classification as a table, the NVML probe against a fake NVML on CPU,
the pre-flight refusal and the monitor's drain (once, through the given drain function)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from trainguard.agent.health import (FATAL_XIDS, THROTTLE_HW_THERMAL, THROTTLE_SW_POWER_CAP, FileProbe, GpuHealth,
                                     GpuSample, HealthConfig, HealthMonitor, NvmlProbe, classify, open_probe, preflight)
from trainguard.contract.configbase import ConfigError
from trainguard.metrics.straggler import GPU_HEALTH_STATES


@pytest.mark.parametrize("sample,state,reasons", [
    (GpuSample(index=0), GpuHealth.OK, ()),
    (GpuSample(index=0, xids=(13,)), GpuHealth.OK, ()),  # a graphics engine exception: the app's fault, not the GPU's
    (GpuSample(index=0, xids=(79, 48, 79)), GpuHealth.FATAL, ("xid_48", "xid_79")),
    (GpuSample(index=0, dbe_volatile=2), GpuHealth.FATAL, ("ecc_double_bit",)),
    (GpuSample(index=0, retired_pending=True), GpuHealth.FATAL, ("retired_pages_pending",)),
    (GpuSample(index=0, remap_pending=True, remap_failed=True), GpuHealth.FATAL, ("row_remap_pending", "row_remap_failed")),
    (GpuSample(index=0, throttle_reasons=THROTTLE_HW_THERMAL), GpuHealth.DEGRADED, ("hw_thermal",)),
    (GpuSample(index=0, throttle_reasons=THROTTLE_SW_POWER_CAP | THROTTLE_HW_THERMAL), GpuHealth.DEGRADED,
     ("hw_thermal", "sw_power_cap")),
    (GpuSample(index=0, throttle_reasons=0x1), GpuHealth.OK, ()),  # GPU idle: not a slowdown
    (GpuSample(index=0, pcie_width=8, pcie_max_width=16), GpuHealth.DEGRADED, ("pcie_x8_of_x16",)),
    (GpuSample(index=0, pcie_width=16, pcie_max_width=16), GpuHealth.OK, ()),
    (GpuSample(index=0, xids=(94,), throttle_reasons=THROTTLE_HW_THERMAL), GpuHealth.FATAL, ("xid_94",)),
])
def test_classify(sample, state, reasons):
    v = classify(sample)
    assert v.state is state and sorted(v.reasons) == sorted(reasons)


def test_throttling_can_be_ignored_and_labels_match_the_metric():
    assert classify(GpuSample(index=0, throttle_reasons=THROTTLE_HW_THERMAL), throttle_is_degraded=False).state is GpuHealth.OK
    assert tuple(h.value for h in GpuHealth) == GPU_HEALTH_STATES
    assert 48 in FATAL_XIDS and 13 not in FATAL_XIDS


class FakeNvml:
    """The slice of pynvml the health probe reads, with scripted GPUs."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, gpus: list[dict], *, events: bool = True) -> None:
        self.gpus = gpus
        self.queue: list[SimpleNamespace] = []
        self.events = events
        self.shutdowns = 0

    def nvmlInit(self): pass
    def nvmlShutdown(self): self.shutdowns += 1
    def nvmlDeviceGetCount(self): return len(self.gpus)
    def nvmlDeviceGetHandleByIndex(self, i): return ("h", i)

    def nvmlEventSetCreate(self):
        if not self.events:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return "set"

    def nvmlDeviceRegisterEvents(self, h, types, s): pass
    def nvmlEventSetFree(self, s): pass

    def nvmlEventSetWait(self, s, timeout_ms):
        if not self.queue:
            raise RuntimeError("NVML_ERROR_TIMEOUT")
        return self.queue.pop(0)

    def _g(self, h): return self.gpus[h[1]]
    def nvmlDeviceGetTotalEccErrors(self, h, t, c): return self._g(h).get("dbe", 0)
    def nvmlDeviceGetRetiredPagesPendingStatus(self, h): return self._g(h).get("retired", 0)
    def nvmlDeviceGetRemappedRows(self, h): return self._g(h).get("remap", (0, 0, 0, 0))

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        raise AttributeError("older driver")  # the probe falls back to the throttle-reasons call

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h): return self._g(h).get("throttle", 0)
    def nvmlDeviceGetCurrPcieLinkWidth(self, h): return self._g(h).get("width", 16)
    def nvmlDeviceGetMaxPcieLinkWidth(self, h): return 16

    def nvmlDeviceGetUUID(self, h):
        if "unsupported" in self._g(h):
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return f"GPU-{h[1]}".encode()


def test_nvml_probe_reads_every_condition_and_xid_events():
    nv = FakeNvml([{}, {"dbe": 1, "remap": (0, 1, 1, 0), "throttle": THROTTLE_HW_THERMAL, "width": 4, "unsupported": 1}])
    nv.queue.append(SimpleNamespace(device=("h", 0), eventData=79))
    probe = NvmlProbe(nv)
    assert probe.reason == ""
    a, b = probe.read()
    assert (a.label, a.xids) == ("GPU-0", (79,))
    assert (b.label, b.dbe_volatile, b.remap_pending, b.throttle_reasons, b.pcie_width) == ("1", 1, True, THROTTLE_HW_THERMAL, 4)
    assert probe.read()[0].xids == ()  # an XID is reported once
    probe.close()
    assert nv.shutdowns == 1


def test_nvml_probe_unavailable_and_without_events():
    class NoDriver:
        def nvmlInit(self):
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    assert "NVML unavailable" in NvmlProbe(NoDriver()).reason
    assert NvmlProbe(FakeNvml([])).reason == "NVML sees no GPU"
    probe = NvmlProbe(FakeNvml([{"dbe": 3}], events=False))
    assert probe.read()[0].dbe_volatile == 3  # everything but the XIDs is still read


def test_preflight_refuses_a_fatal_gpu_naming_the_key_and_env_var(tmp_path):
    f = tmp_path / "gpus.json"
    f.write_text(json.dumps([{"index": 0}, {"index": 1, "xids": [48]}]))
    with pytest.raises(ConfigError) as e:
        open_probe(HealthConfig(probe_file=str(f)))
    text = str(e.value)
    assert "GPU 1: xid_48" in text and "health.enabled" in text and "TRAINGUARD_HEALTH_ENABLED" in text
    verdicts = preflight(FileProbe(str(f)), HealthConfig(on_fatal="report"))
    assert verdicts["1"].state is GpuHealth.FATAL  # reported, the node starts
    f.write_text(json.dumps([{"index": 0, "pcie_width": 8, "pcie_max_width": 16}]))
    assert open_probe(HealthConfig(probe_file=str(f))) is not None
    assert open_probe(HealthConfig(enabled=False, probe_file=str(f))) is None


class Observed:
    def __init__(self) -> None:
        self.health: dict[str, str] = {}
        self.evictions: list[str] = []

    def set_gpu_health(self, gpu, state):
        self.health[gpu] = state

    def evicted(self, cause):
        self.evictions.append(cause)


def test_monitor_drains_once_on_a_fatal_gpu_and_exports_every_state(tmp_path):
    f = tmp_path / "gpus.json"
    f.write_text(json.dumps([{"index": 0}, {"index": 1}]))
    drains: list[str] = []
    obs = Observed()
    mon = HealthMonitor(FileProbe(str(f)), HealthConfig(probe_file=str(f)), drains.append, obs)
    mon.poll()
    assert drains == [] and obs.health == {"0": "ok", "1": "ok"}
    f.write_text(json.dumps([{"index": 0, "throttle_reasons": THROTTLE_HW_THERMAL}, {"index": 1, "xids": [79]}]))
    mon.poll()
    mon.poll()
    assert obs.health == {"0": "degraded", "1": "fatal"}
    assert len(drains) == 1 and "GPU 1: xid_79" in drains[0] and obs.evictions == ["gpu_health"]


def test_monitor_reports_only_when_configured():
    drains: list[str] = []
    probe = SimpleNamespace(read=lambda: [GpuSample(index=0, dbe_volatile=1)], close=lambda: None, reason="")
    HealthMonitor(probe, HealthConfig(on_fatal="report"), drains.append).poll()
    assert drains == []
