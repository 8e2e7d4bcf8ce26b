"""The agent's side of straggler detection: the store records, the decider and the spare's admission.

The rules are :mod:`trainguard.agent.straggler` (pure); this module does the I/O around them.
:class:`StragglerMonitor` runs in the supervisor's loop (one :meth:`~StragglerMonitor.tick` per
keep-alive interval) and reads the workers' :class:`~trainguard.contract.protocol.Pace` reports from the
control thread. :func:`wait_as_spare` runs before a node enters the rendezvous. Store keys (the c10d
endpoint store, outside any round's prefix so that they outlive a world)::

    trainguard/straggler/<job>/nodes           node names, appended once per agent life
    trainguard/straggler/<job>/pace/<node>     PaceRecord JSON, rewritten every keep-alive interval
    trainguard/straggler/<job>/evictions       Eviction JSON lines, appended by the decider
    trainguard/straggler/<job>/selftest/<node> the node's last self-test time (seconds, JSON)

Never raises into the supervisor: a store failure is one ``straggler_unavailable`` line and the job trains on.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from trainguard.agent.straggler import (KEY_PREFIX, AdmissionAct, Eviction, PaceRecord, PaceWindow, StragglerConfig,
                                        StragglerDecision, Verdict, decide_admission, decide_straggler)
from trainguard.contract import protocol as proto
from trainguard.contract.log import get_logger

log = get_logger("trainguard.agent.straggler")

CAUSE_STRAGGLER = proto.EvictionCause.STRAGGLER.value
CAUSE_HEALTH = proto.EvictionCause.GPU_HEALTH.value
"""``reason`` labels of ``trainguard_evictions_total`` (and the ``cause`` of the eviction records)."""
READMISSION_CAUSES = ("selftest_passed",)
"""``cause`` label of ``trainguard_node_readmissions_total``."""


def _keys(job: str) -> dict[str, str]:
    base = f"{KEY_PREFIX}{job}/"
    return {"nodes": base + "nodes", "pace": base + "pace/", "evictions": base + "evictions", "selftest": base + "selftest/"}


def _get(store: Any, key: str) -> bytes | None:
    return bytes(store.get(key)) if store.check([key]) else None


def read_evictions(store: Any, job: str) -> list[Eviction]:
    data = _get(store, _keys(job)["evictions"])
    return Eviction.parse_log(data) if data else []


def _metrics(observer: Any) -> Any:
    return getattr(observer, "straggler", None) if observer is not None else None


class StragglerMonitor:
    """One node's straggler bookkeeping. ``request_drain(reason)`` drains this node (the supervisor's
    planned drain); ``observer``: the agent metrics (their ``straggler`` part), or None."""

    def __init__(self, cfg: StragglerConfig, *, job_id: str, node: str, min_nodes: int, interval_s: float,
                 request_drain: Callable[[str], Any], observer: Any = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.cfg, self.job, self.node, self.min_nodes = cfg, job_id, node, min_nodes
        self.interval_s = interval_s
        self._request_drain = request_drain
        self._observer = observer
        self._clock, self._wall = clock, wall
        self.window = PaceWindow(cfg.window_s, clock)
        self._keys = _keys(job_id)
        self._started = wall()
        self._next = 0.0
        self._round: int | None = None
        self._above: dict[str, float] = {}
        self._said: dict[str, tuple[Verdict, str]] = {}
        self._registered = False
        self._evicted = False
        self._evicting: dict[str, float] = {}
        self._unavailable = False
        self._last_tick: float | None = None
        self.last: StragglerDecision | None = None

    def observe(self, msg: proto.Pace) -> None:
        """A worker's report (control thread)."""
        self.window.add(msg)

    def tick(self, store: Any, *, round_: int, nodes: int, decides: bool) -> StragglerDecision | None:
        """Publish, read, decide (every :attr:`interval_s`; other calls return None). ``decides``: this
        node hosts global rank 0 (it alone logs the decisions and evicts)."""
        now = self._clock()
        if round_ != self._round:  # a new world: its members are scored afresh, none of the last one's shown
            self._round, self._above = round_, {}
            self.window.clear()
            m = _metrics(self._observer)
            if m is not None:
                m.set_scores({})
        if now < self._next:
            return None
        self._next = now + self.interval_s
        if store is None:
            self._unavailable_once("the rendezvous backend has no shared store (straggler records need c10d)")
            return None
        try:
            return self._tick(store, round_, nodes, decides, now)
        except Exception as e:  # noqa: BLE001 - the detector must never stop supervision
            self._unavailable_once(f"{type(e).__name__}: {e}"[:300])
            return None

    def _unavailable_once(self, why: str) -> None:
        if not self._unavailable:
            self._unavailable = True
            log.info("straggler_unavailable", reason=why, effect="no straggler detection on this node until the store answers")

    def _tick(self, store: Any, round_: int, nodes: int, decides: bool, now: float) -> StragglerDecision:
        wall = self._wall()
        if not self._registered:
            store.append(self._keys["nodes"], (self.node + "\n").encode())
            self._registered = True
        mine = self.window.node_value(self.cfg.min_samples)
        if mine is not None:
            store.set(self._keys["pace"] + self.node,
                      PaceRecord(self.node, mine[0], mine[1], round_, wall).to_json())
        evictions = read_evictions(store, self.job)
        for e in evictions:
            if e.node == self.node and e.unix_s >= self._started and not self._evicted:
                self._evicted = True
                log.warning("straggler_eviction_received", node=self.node, score=e.score, cause=e.cause,
                            effect="draining this node: emergency checkpoint, the survivors re-form in place")
                self._request_drain(f"evicted as a straggler (score {e.score})")
        names = sorted({n for n in (_get(store, self._keys["nodes"]) or b"").decode(errors="replace").split("\n") if n})
        values: dict[str, float] = {}
        for n in names:
            raw = _get(store, self._keys["pace"] + n)
            r = PaceRecord.from_json(raw) if raw is not None else None
            if r is not None and r.round == round_ and wall - r.unix_s <= self.cfg.window_s:
                values[r.node] = r.median_s
        d = decide_straggler(values, now=wall, above_since=self._above, nodes=nodes, min_nodes=self.min_nodes,
                             evictions=[e.unix_s for e in evictions if e.cause == CAUSE_STRAGGLER], cfg=self.cfg)
        self._above = dict(d.above_since)
        self.last = d
        m = _metrics(self._observer)
        if m is not None:
            m.set_scores(d.scores)
            if d.verdict in (Verdict.KEEP, Verdict.EVICT) and self._last_tick is not None:
                m.straggler_time(now - self._last_tick)
        self._last_tick = now
        if decides:
            self._say(d, values)
            if d.verdict is Verdict.EVICT and d.node is not None and wall - self._evicting.get(d.node, -1e18) > self.cfg.cooldown_s:
                self._evicting[d.node] = wall
                store.append(self._keys["evictions"], Eviction(d.node, wall, CAUSE_STRAGGLER, round(d.score or 0, 3)).to_line())
                if m is not None:
                    m.evicted(CAUSE_STRAGGLER)
        return d

    def _say(self, d: StragglerDecision, values: dict[str, float]) -> None:
        """One log line per change of a node's verdict (and reason)."""
        now_said: dict[str, tuple[Verdict, str]] = {}
        if d.node is not None:
            now_said[d.node] = (d.verdict, d.reason)
        for node, (verdict, _) in self._said.items():
            if node not in now_said and verdict is not Verdict.NONE:
                log.info("straggler_cleared", node=node, score=round(d.scores.get(node, 0.0), 3))
        for node, said in now_said.items():
            if self._said.get(node) == said:
                continue
            fields = {"node": node, "score": round(d.score or 0.0, 3), "threshold": self.cfg.threshold,
                      "compute_s": round(values.get(node, 0.0), 4),
                      "others_s": round(statistics.median(v for n, v in values.items() if n != node), 4)}
            if d.gain is not None:
                fields["projected_gain"] = round(d.gain, 3)
            if d.verdict is Verdict.SUSPECT:
                log.info("straggler_suspected", sustain_s=self.cfg.sustain_s, **fields)
            elif d.verdict is Verdict.KEEP:
                log.warning("straggler_kept", reason=d.reason, action=self.cfg.action, **fields)
            elif d.verdict is Verdict.EVICT:
                log.warning("straggler_evicted", margin=self.cfg.margin, **fields,
                            effect="the node drains through the planned path; it may come back after "
                                   f"straggler.cooldown_s ({self.cfg.cooldown_s:g} s) and a self-test")
        self._said = now_said


# ---- the spare's admission ------------------------------------------------------------------------

_SELFTEST_N = 256


def selftest(reps: int, device: str = "cpu", clock: Callable[[], float] = time.perf_counter, runs: int = 5) -> float:
    """Time a fixed matrix-multiply loop on ``device`` (``reps`` multiplies of 256x256 float32, the same
    work on every node): the median of ``runs`` timed runs (robust to a burst of load), in seconds."""
    import torch

    a = torch.randn(_SELFTEST_N, _SELFTEST_N, device=device)
    b = torch.randn(_SELFTEST_N, _SELFTEST_N, device=device)

    def run(n: int) -> float:
        t0 = clock()
        c = a
        for _ in range(n):
            c = torch.tanh(c @ b)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return clock() - t0

    return statistics.median(run(reps) for _ in range(runs))


def selftest_devices(cuda_count: int) -> list[str]:
    """Pure: the devices a node's self-test times: every GPU it sees (the slowest sets the node's time: a
    throttled GPU is what makes a straggler), else the CPU."""
    return [f"cuda:{i}" for i in range(max(0, cuda_count))] or ["cpu"]


def selftest_node(reps: int, runs: int = 5) -> tuple[float, str]:
    """:func:`selftest` on each of :func:`selftest_devices`: the slowest time and its device."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    times = {d: selftest(reps, d, runs=runs) for d in selftest_devices(count)}
    slowest = max(times, key=lambda d: times[d])
    return times[slowest], slowest


SELFTEST_TIMEOUT_S = 300.0


def selftest_in_child(reps: int, timeout_s: float = SELFTEST_TIMEOUT_S) -> float:
    """:func:`selftest_node` in a child process, so that the CUDA contexts it makes on a GPU node go with
    it (the agent holds no GPU memory; its workers start after). Falls back to the CPU in this process
    when the child fails (logged)."""
    import subprocess
    import sys

    code = ("import json, sys; from trainguard.agent.stragglermon import selftest_node; "
            "s, d = selftest_node(int(sys.argv[1])); print(json.dumps({'seconds': s, 'device': d}))")
    try:
        out = subprocess.run([sys.executable, "-c", code, str(reps)], capture_output=True, text=True,
                             timeout=timeout_s, check=True)
        rec = json.loads(out.stdout.strip().splitlines()[-1])
        log.info("straggler_selftest_device", device=rec["device"], seconds=round(float(rec["seconds"]), 4))
        return float(rec["seconds"])
    except Exception as e:  # noqa: BLE001 - a self-test still runs, on this process's CPU
        log.warning("straggler_selftest_child_failed", error=f"{type(e).__name__}: {e}"[:300],
                    effect="the self-test runs on the agent's CPU")
        return selftest(reps)


def wait_as_spare(store: Any, cfg: StragglerConfig, *, job_id: str, node: str, stop: Callable[[], bool],
                  device: str = "auto", observer: Any = None, wall: Callable[[], float] = time.time,
                  sleep: Callable[[float], None] = time.sleep,
                  test: Callable[[], float] | None = None) -> AdmissionAct:
    """Before this node enters a world: wait out a straggler eviction's cool-down, pass the self-test,
    or be quarantined. Returns ``ADMIT`` or ``QUARANTINE`` (or ``WAIT`` when ``stop()`` became true).
    Publishes this node's self-test time for the others' admissions. A store that cannot be read admits.
    ``device`` ``auto``: :func:`selftest_in_child` (every GPU of the node, else the CPU); a device name:
    :func:`selftest` on it in this process."""
    keys = _keys(job_id)
    try:
        mine = [e.unix_s for e in read_evictions(store, job_id) if e.node == node and e.cause == CAUSE_STRAGGLER]
    except Exception as e:  # noqa: BLE001 - admission is a hint, never a reason not to start
        log.info("straggler_unavailable", reason=f"{type(e).__name__}: {e}"[:300], effect="admitted without a check")
        return AdmissionAct.ADMIT
    run = test if test is not None else ((lambda: selftest(cfg.selftest_reps, device)) if device != "auto"
                                         else (lambda: selftest_in_child(cfg.selftest_reps)))
    tested: float | None = None
    failed_at: float | None = None
    said = None
    while not stop():
        others = []
        try:
            for n in (_get(store, keys["nodes"]) or b"").decode(errors="replace").split("\n"):
                raw = _get(store, keys["selftest"] + n) if n and n != node else None
                if raw:
                    others.append(float(json.loads(raw)["seconds"]))
        except Exception:  # noqa: BLE001 - no reference: the self-test passes
            others = []
        # The fastest of the others: a self-test taken under a burst of load reads slow, and a reference
        # that is too slow would let a slow node back in (seen on a loaded host); too fast only costs a
        # healthy node another cool-down.
        ref = min(others) if others else None
        a = decide_admission(now=wall(), evicted_at=mine, selftest_s=tested, reference_s=ref, failed_at=failed_at, cfg=cfg)
        if (a.act, a.reason) != said:
            said = (a.act, a.reason)
            fields = {"node": node, "reason": a.reason, "evictions": len(mine), "selftest_s": tested, "reference_s": ref}
            if a.act is AdmissionAct.QUARANTINE:
                log.error("straggler_quarantined", **fields, effect="this node stays out of the job",
                          fix="check the node's hardware; raise straggler.quarantine_after "
                              "(TRAINGUARD_STRAGGLER_QUARANTINE_AFTER) to let it back in")
            elif a.act is AdmissionAct.WAIT:
                log.info("straggler_spare_waiting", wait_s=round(a.wait_s, 1), **fields)
            elif a.act is AdmissionAct.ADMIT and mine:
                log.info("straggler_readmitted", **fields)
        if a.act is AdmissionAct.SELFTEST or (a.act is AdmissionAct.ADMIT and tested is None):
            tested = run()
            log.info("straggler_selftest", node=node, seconds=round(tested, 4), reference_s=ref, reps=cfg.selftest_reps)
            try:
                store.append(keys["nodes"], (node + "\n").encode())
                store.set(keys["selftest"] + node, json.dumps({"seconds": tested, "unix_s": wall()}).encode())
            except Exception:  # noqa: BLE001
                pass
            if a.act is AdmissionAct.ADMIT:
                return a.act
            continue
        if a.act is AdmissionAct.WAIT:
            if a.reason == "selftest_failed" and tested is not None:
                failed_at, tested = wall(), None
            sleep(min(1.0, max(0.01, a.wait_s)))
            continue
        if a.act is AdmissionAct.ADMIT and mine:
            m = _metrics(observer)
            if m is not None:
                m.readmitted("selftest_passed")
        return a.act
    return AdmissionAct.WAIT
