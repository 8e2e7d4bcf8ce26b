"""Stragglers on localhost agents (issue 38): detection, eviction that pays off, re-admission (benchmark,
not a timed test). Prints a table and writes ``--json PATH``.

Every scenario is a fresh cluster: an external ``trainguard store`` and ``trainguard run`` agents (one
worker each) training ``examples/train_gpt_elastic.py`` (the end-to-end tests' small model, the chaos
bench's arguments) with ``--sample-sleep``: emulated accelerator time per sample of a rank's share of the
global batch (slept in 2 ms slices), so that a rank's step scales with its share, as on a GPU, and the
2 shared CPU cores of this machine do not decide who is slow. Stragglers are made from outside the job
by the duty-cycle throttler (``tests/fixtures/throttle.py``: SIGSTOP/SIGCONT of the node's agent and
workers, a fraction of every 100 ms). The agents run ``straggler.action: evict`` with a short window
(``AGENT_SETS``).

Scenarios, side by side in one run:

* ``two_healthy``: 2 nodes, no straggler: steps/s (the reference for the next one);
* ``half_speed``: 3 nodes, one stopped 50 % of each 100 ms: time from the throttle to the eviction,
  steps/s after it against ``two_healthy``; then the evicted node's agent is started again with the
  throttle still on (its self-test must fail), the throttle is removed, and the time to its re-admission
  (self-test passed, world of 3 training again) is measured. Every sample once over the whole scenario
  (the chaos bench's sample account: the sample log against the global cursor);
* ``ten_percent``: 3 nodes, one stopped 10 % of each 100 ms, for ``--observe`` seconds: kept (the rule
  says the job is faster with it) and reported (``straggler_kept``);
* ``no_straggler``: 3 nodes for ``--observe`` seconds: evictions (0 expected) and reports;
* ``gpu_xid``: n3's (fake, ``health.probe_file``) NVML reports XID 79: drained with an emergency
  checkpoint (``evict_s``: from the XID to the drain), the survivors go on, every sample once.

Run: ``OMP_NUM_THREADS=1 python bench/straggler.py [--observe 60] [--measure 30] [--json out.json]``.
The figures are noisy on a loaded machine: the table says what the host's load was.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

import chaos  # noqa: E402  (its cluster pieces: the store, the agent reader, the sample account)
from tests.fixtures.throttle import DutyCycleThrottler  # noqa: E402
from tests.harness import memory_root  # noqa: E402

SAMPLE_SLEEP_S = 0.005
SCRIPT_ARGS = [a if a != "--step-sleep" else "--sample-sleep" for a in chaos.SCRIPT_ARGS]
SCRIPT_ARGS[SCRIPT_ARGS.index("--sample-sleep") + 1] = str(SAMPLE_SLEEP_S)
AGENT_SETS = ["straggler.action=evict", "straggler.threshold=1.05", "straggler.sustain_s=10", "straggler.window_s=10",
              "straggler.min_samples=5", "straggler.cooldown_s=15", "straggler.max_evictions_per_hour=10",
              "straggler.readmit_ratio=1.3"]


class _NoEmulator:
    def close(self) -> None:
        pass


class Node(chaos.Agent):
    """One ``trainguard run`` agent (chaos's reader and process handling; local checkpoints, no cloud)."""

    def __init__(self, name: str, work: str, endpoint: str, nodes: str, extra: tuple[str, ...] = ()) -> None:  # noqa: D107
        self.name = name
        self.emu = _NoEmulator()
        self.state_dir = os.path.join(work, f"state-{name}")
        cmd = [sys.executable, "-m", "trainguard.agent.cli", "run", "--nnodes", nodes, "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", chaos.JOB_ID, "--node-name", name,
               "--state-dir", self.state_dir, "--log-dir", os.path.join(work, f"logs-{name}"),
               "--monitor-interval", "0.2", "--set", "agent.log_format=json", "--set", "metrics.port=0",
               "--set", "rendezvous.is_host=false", "--set", "rendezvous.keep_alive_interval_s=1",
               "--set", "rendezvous.keep_alive_max_attempts=3", "--set", "preemption.sources=signal",
               "--set", f"checkpoint.url={os.path.join(work, 'ckpt')}", "--set", "checkpoint.interval_steps=100000",
               "--set", f"checkpoint.memory_dir={memory_root(work)}", "--set", "workers.max_restarts=100",
               *[x for s in (*AGENT_SETS, *extra) for x in ("--set", s)],
               chaos.ELASTIC, *SCRIPT_ARGS, "--sample-log", os.path.join(work, "samples")]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
        env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo"})
        self._lock = threading.Lock()
        self.ev: list[tuple[float, dict[str, Any]]] = []
        self.lines: list[str] = []
        self._fh = open(os.path.join(work, f"{name}.log"), "a")
        self.started = time.time()
        self.proc = chaos.subprocess.Popen(cmd, stdout=chaos.subprocess.PIPE, stderr=chaos.subprocess.STDOUT, env=env,
                                           cwd=REPO, start_new_session=True)
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()


class Cluster:
    def __init__(self, work: str, n: int, extra: dict[str, tuple[str, ...]] | None = None) -> None:
        self.work = work
        self.extra = extra or {}
        os.makedirs(os.path.join(work, "samples"), exist_ok=True)
        self.store = chaos.Store(work)
        self.nodes: list[Node] = []
        self.gone: list[Node] = []
        self.throttles: list[DutyCycleThrottler] = []
        for i in range(n):  # one at a time: on real nodes the start-up self-tests share no CPU
            node = self.add(f"n{i + 1}")
            chaos.wait_for(lambda: node.events("straggler_selftest") or not node.running, 120)

    def add(self, name: str) -> Node:
        node = Node(name, self.work, self.store.endpoint, "1:3", self.extra.get(name, ()))
        self.nodes.append(node)
        return node

    def all(self) -> list[Node]:
        return self.nodes + self.gone

    def events(self, name: str, since: float = 0.0) -> list[tuple[float, dict[str, Any]]]:
        return sorted((te for a in self.all() for te in a.events(name, since)), key=lambda te: te[0])

    def steps(self, since: float = 0.0) -> list[tuple[float, dict[str, Any]]]:
        return self.events("train_step", since)

    def training_at(self, world: int, since: float, n: int = 5) -> bool:
        return len([1 for _, e in self.steps(since) if e.get("world_size") == world]) >= n

    def wait_training(self, world: int, timeout: float, what: str) -> float:
        since = time.time()
        if chaos.wait_for(lambda: self.training_at(world, since), timeout) is None:
            raise chaos.ChaosError(f"timed out after {timeout:.0f}s waiting for {what}")
        return time.time()

    def rate(self, t0: float, t1: float, world: int) -> float | None:
        """Steps per second between ``t0`` and ``t1`` (rank 0's step log, world ``world`` only)."""
        s = [(t, e["step"]) for t, e in self.steps(t0) if t <= t1 and e.get("world_size") == world]
        if len(s) < 2 or s[-1][0] <= s[0][0]:
            return None
        return (s[-1][1] - s[0][1]) / (s[-1][0] - s[0][0])

    def throttle(self, target: Any, fraction: float) -> DutyCycleThrottler:
        """Throttle ``target()``'s node (its agent and workers) from now until :meth:`close` at the latest."""
        t = DutyCycleThrottler(lambda: node_tree(target()), fraction, 0.1).start()
        self.throttles.append(t)
        return t

    def close(self) -> None:
        for t in self.throttles:
            t.stop()
        for a in self.all():
            a.close()
        self.store.stop()


def node_tree(node: Node) -> set[int]:
    return chaos.tree(node.proc.pid) if node.running else set()


@dataclass
class Row:
    scenario: str
    nodes: int
    throttle: str
    steps_per_s: float | None = None
    steps_per_s_ref: float | None = None
    evictions: int = 0
    evicted: list[str] = field(default_factory=list)
    detect_s: float | None = None
    evict_s: float | None = None
    kept_reports: dict[str, int] = field(default_factory=dict)
    kept_reasons: list[str] = field(default_factory=list)
    max_score: dict[str, float] = field(default_factory=dict)
    selftest_failed_while_throttled: bool | None = None
    readmit_s: float | None = None
    samples_skipped: int | None = None
    samples_repeated: int | None = None
    sample_errors: list[str] = field(default_factory=list)
    observed_s: float = 0.0
    steps_per_s_before: float | None = None
    """half_speed: the world of 3 before the throttle."""
    steps_per_s_throttled: float | None = None
    """half_speed: the world of 3 from the throttle to the eviction."""
    steps_per_s_readmitted: float | None = None
    """half_speed: the world of 3 again, after the re-admission."""
    hangs: list[str] = field(default_factory=list)
    """Every ``hang_detected`` line of the scenario (``node:culprit_by/action``): a false hang where nothing hung."""
    load_avg: list[float] = field(default_factory=list)
    """The host's 1-minute load average at the scenario's start and end (2 CPUs shared with other jobs)."""
    note: str = ""


def account_samples(row: Row, work: str) -> None:
    """Every sample once: the chaos bench's account of the sample log against the global cursor."""
    row.samples_skipped, row.samples_repeated, row.sample_errors = chaos.sample_account(os.path.join(work, "samples"))


def straggler_lines(c: Cluster, since: float, row: Row) -> None:
    for _, e in c.events("straggler_kept", since):
        row.kept_reports[e["node"]] = row.kept_reports.get(e["node"], 0) + 1
        if e.get("reason") not in row.kept_reasons:
            row.kept_reasons.append(e.get("reason"))
    for ev in ("straggler_suspected", "straggler_kept", "straggler_evicted"):
        for _, e in c.events(ev, since):
            row.max_score[e["node"]] = max(row.max_score.get(e["node"], 0.0), float(e.get("score") or 0))
    row.hangs = [f"{e.get('node')}:{e.get('culprit_by')}/{e.get('action')}" for _, e in c.events("hang_detected", since)]
    evicted = c.events("straggler_evicted", since)
    row.evictions = len(evicted)
    row.evicted = [e["node"] for _, e in evicted]


def observe(work: str, name: str, nodes: int, fraction: float | None, seconds: float) -> Row:
    """``nodes`` nodes, the last one throttled by ``fraction`` (None: none), for ``seconds``."""
    row = Row(name, nodes, f"n{nodes} stopped {fraction:.0%} of 100 ms" if fraction else "none")
    c = Cluster(work, nodes)
    try:
        c.wait_training(nodes, 300, f"a world of {nodes}")
        time.sleep(5)
        t0 = time.time()
        if fraction:
            last = c.nodes[-1]
            c.throttle(lambda: last, fraction)
        time.sleep(seconds)
        row.steps_per_s = c.rate(t0, time.time(), nodes)
        row.observed_s = seconds
        straggler_lines(c, t0, row)
    finally:
        c.close()
    return row


def half_speed(work: str, measure: float) -> Row:
    row = Row("half_speed", 3, "n3 stopped 50% of 100 ms, then removed")
    c = Cluster(work, 3)
    try:
        c.wait_training(3, 300, "a world of 3")
        t_before = time.time() + 5
        time.sleep(5 + measure / 2)
        row.steps_per_s_before = c.rate(t_before, time.time(), 3)
        n3 = c.nodes[2]
        target = {"node": n3}
        throttle = c.throttle(lambda: target["node"], 0.5)
        t_thr = time.time()
        chaos.say("n3 throttled to half speed")
        ev = chaos.wait_for(lambda: [e for e in c.events("straggler_evicted", t_thr) if e[1]["node"] == "n3"], 180)
        if not ev:
            row.note = "not evicted within 180 s"
            straggler_lines(c, t_thr, row)
            return row
        row.evict_s = ev[0][0] - t_thr
        row.steps_per_s_throttled = c.rate(t_thr, ev[0][0], 3)
        sus = [t for t, e in c.events("straggler_suspected", t_thr) if e["node"] == "n3"]
        row.detect_s = (sus[0] - t_thr) if sus else None
        chaos.say(f"n3 evicted after {row.evict_s:.1f} s")
        chaos.wait_for(lambda: not n3.running, 120)
        t_w2 = c.wait_training(2, 120, "the world of 2 after the eviction")
        time.sleep(15)
        t0 = time.time()
        time.sleep(measure)
        row.steps_per_s = c.rate(t0, time.time(), 2)
        straggler_lines(c, t_thr, row)
        # Re-admission: the node's agent starts again (systemd restart / the operator) with the throttle on.
        c.nodes.remove(n3)
        c.gone.append(n3)
        t_restart = time.time()
        n3b = c.add("n3")
        target["node"] = n3b
        failed = chaos.wait_for(lambda: [e for _, e in n3b.events("straggler_spare_waiting", t_restart)
                                         if e.get("reason") == "selftest_failed"], 120)
        row.selftest_failed_while_throttled = bool(failed)
        throttle.stop()
        t_off = time.time()
        chaos.say(f"throttle removed; the self-test failed while throttled: {bool(failed)}")
        ok = chaos.wait_for(lambda: n3b.events("straggler_readmitted", t_restart), 180)
        if ok:
            try:
                c.wait_training(3, 180, "the world of 3 after the re-admission")
                row.readmit_s = time.time() - t_off
                t_back = time.time() + 5
                time.sleep(5 + measure / 2)
                row.steps_per_s_readmitted = c.rate(t_back, time.time(), 3)
            except chaos.ChaosError as e:  # the row keeps what was measured
                row.note = str(e)
        else:
            row.note = "not re-admitted within 180 s"
        row.observed_s = time.time() - t_w2
        account_samples(row, work)
    finally:
        c.close()
    return row


def gpu_xid(work: str, measure: float) -> Row:
    """n3's GPU reports a fatal XID (a fake NVML: ``health.probe_file``): drained with an emergency
    checkpoint, the survivors go on in place, no step lost or repeated."""
    row = Row("gpu_xid", 3, "n3 fake NVML: XID 79")
    probe = os.path.join(work, "gpus-n3.json")
    with open(probe, "w") as fh:
        json.dump([{"index": 0}], fh)
    c = Cluster(work, 3, {"n3": (f"health.probe_file={probe}", "health.interval_s=0.5")})
    try:
        c.wait_training(3, 300, "a world of 3")
        time.sleep(5)
        t0 = time.time()
        with open(probe + ".tmp", "w") as fh:
            json.dump([{"index": 0, "xids": [79]}], fh)
        os.replace(probe + ".tmp", probe)
        n3 = c.nodes[2]
        drained = chaos.wait_for(lambda: n3.events("gpu_health_drain", t0), 60)
        committed = chaos.wait_for(lambda: [e for _, e in n3.events("checkpoint_committed_by_worker", t0)
                                            if e.get("kind") == "emergency"], 60)
        row.evict_s = (drained[0][0] - t0) if drained else None
        row.evictions, row.evicted = (1, ["n3"]) if drained else (0, [])
        row.note = "emergency checkpoint committed" if committed else "no emergency checkpoint"
        chaos.wait_for(lambda: not n3.running, 120)
        t_w2 = c.wait_training(2, 120, "the world of 2 after the drain")
        time.sleep(measure)
        row.steps_per_s = c.rate(t_w2, time.time(), 2)
        row.observed_s = time.time() - t0
        account_samples(row, work)
    finally:
        c.close()
    return row


def fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def table(rows: list[Row], load: tuple[float, float, float]) -> str:
    out = [f"host load average (1/5/15 min) at the end: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} on {os.cpu_count()} CPUs",
           f"{'scenario':<14}{'nodes':>6} {'steps/s':>8} {'evictions':>10} {'evicted':>8} {'detect_s':>9} {'evict_s':>8} "
           f"{'readmit_s':>10} {'kept reports (reason)':<34} {'samples skip/rep':>16} {'load 1m':>11}"]
    for r in rows:
        kept = ", ".join(f"{n}x{k}" for n, k in sorted(r.kept_reports.items()))
        kept = (kept + (f" ({'/'.join(r.kept_reasons)})" if r.kept_reasons else "")) or "-"
        samples = "-" if r.samples_skipped is None else f"{r.samples_skipped}/{r.samples_repeated}"
        out.append(f"{r.scenario:<14}{r.nodes:>6} {fmt(r.steps_per_s):>8} {r.evictions:>10} {','.join(r.evicted) or '-':>8} "
                   f"{fmt(r.detect_s, '.1f'):>9} {fmt(r.evict_s, '.1f'):>8} {fmt(r.readmit_s, '.1f'):>10} {kept:<34} {samples:>16} "
                   f"{'/'.join(f'{x:.0f}' for x in r.load_avg) or '-':>11}"
                   + (f"  [{r.note}]" if r.note else "") + (f"  hangs: {', '.join(r.hangs)}" if r.hangs else ""))
    two = next((r for r in rows if r.scenario == "two_healthy"), None)
    half = next((r for r in rows if r.scenario == "half_speed"), None)
    if two and half and two.steps_per_s and half.steps_per_s:
        out.append(f"after the eviction: {half.steps_per_s:.2f} steps/s vs {two.steps_per_s:.2f} on 2 healthy nodes "
                   f"({half.steps_per_s / two.steps_per_s - 1:+.1%})")
    if half is not None and half.steps_per_s_before:
        out.append(f"half_speed, world of 3: {half.steps_per_s_before:.2f} steps/s before the throttle, "
                   f"{fmt(half.steps_per_s_throttled)} throttled (until the eviction), "
                   f"{fmt(half.steps_per_s_readmitted)} after the re-admission")
    if half is not None:
        out.append(f"re-admission: the self-test failed while throttled: {half.selftest_failed_while_throttled}; "
                   f"re-admitted {fmt(half.readmit_s, '.1f')} s after the throttle was removed")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--observe", type=float, default=60.0, help="seconds of the ten_percent and no_straggler runs")
    p.add_argument("--measure", type=float, default=30.0, help="seconds over which steps/s are measured")
    p.add_argument("--only", default="", help="comma-separated scenarios")
    p.add_argument("--json", default="")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    a = p.parse_args()
    root = tempfile.mkdtemp(prefix="tg-strag-", dir="/tmp")
    # half_speed first and two_healthy right after it: the steps/s they compare are measured minutes apart at most
    runs = {"half_speed": lambda w: half_speed(w, a.measure), "two_healthy": lambda w: observe(w, "two_healthy", 2, None, a.measure),
            "ten_percent": lambda w: observe(w, "ten_percent", 3, 0.1, a.observe),
            "no_straggler": lambda w: observe(w, "no_straggler", 3, None, a.observe),
            "gpu_xid": lambda w: gpu_xid(w, a.measure / 3)}
    wanted = [s for s in runs if not a.only or s in a.only.split(",")]
    rows: list[Row] = []
    try:
        for name in wanted:
            chaos.say(f"scenario {name}")
            work = os.path.join(root, name)
            os.makedirs(work)
            load0 = os.getloadavg()[0]
            try:
                rows.append(runs[name](work))
            except chaos.ChaosError as e:
                rows.append(Row(name, 0, "", note=str(e)))
            rows[-1].load_avg = [round(load0, 2), round(os.getloadavg()[0], 2)]
            chaos.say(f"done: {asdict(rows[-1])}")
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    load = os.getloadavg()
    print(table(rows, load))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"rows": [asdict(r) for r in rows], "load_avg": load, "cpus": os.cpu_count(),
                       "sample_sleep_s": SAMPLE_SLEEP_S, "agent_sets": AGENT_SETS, "script_args": SCRIPT_ARGS}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
