"""Goodput on a real spot trace: replay it against local agents, then simulate the whole trace.

1. **Replay.** The membership trace (``time_ms,add|remove,node``, e.g. ``shared/traces/parcae-aws-p3.csv``)
   is scaled to fit two cores: one agent per ``--nodes-per-agent`` trace nodes (at most
   ``--max-agents``), times divided by ``--speed`` (both printed). Each agent is a ``trainguard run``
   on 127.0.0.1 (one CPU/gloo worker training ``examples/train_gpt_elastic.py``) with an AWS IMDSv2
   emulator of its own (``tests/emulators``) and a shared ``trainguard store``. A removal is a spot
   ``instance-action`` served ``--lead-s`` before the node goes (a ``--unannounced`` share of them
   come with no notice at all); when the node's time is up, whatever is left of it is SIGKILLed. An
   addition starts a new agent. The same schedule runs for trainguard with ``checkpoint.interval:
   auto``, with a fixed interval of 50 steps, and for plain ``torchrun`` elastic
   (``examples/train_gpt.py``, ``torch.save`` every 50 steps, no notice handling: every removal is a
   kill at its time).
2. **Measure**, from the agents' and workers' own logs (every step's wall-clock start and end, the
   agents' events) and metrics (scraped every second): ETTR (node-time of steps that end up in the
   final model / node-time available), training time at each world size, per membership change the
   time lost to detection, checkpoint, re-formation, restore and recompute, steps recomputed, samples
   skipped or repeated in the final lineage (must be 0 for trainguard), and each agent's exported
   ``trainguard_goodput_ratio`` against the ground truth.
3. **Simulate** (``bench/spotsim.py``) with the measured per-change cost distributions:
   first the replayed schedule itself (the prediction must be within 2 points of the measured ETTR),
   then the full trace at its real scale (real times, 120 s notices), with the auto interval, fixed
   50 steps, the torchrun baseline, a sweep of fixed intervals (the best one in hindsight), and the
   unannounced share x10 and x0.1.

Prints tables, writes JSON (``--json``) and a PNG of world size and cumulative useful steps over time
(``--plot``; needs matplotlib: ``pip install trainguard[bench]``).

``--keep`` keeps the work folder (logs, sample logs, ``replay.json`` per run); ``--reanalyse FOLDER`` analyses
and simulates such a kept run again (same schedule options) without starting any agent.

``--quick``: a 2-hour window at the same compression, two agents: a few minutes, for CI of the pipeline.
The full default run takes about 15-20 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.recovery import Proc, cursor_stream, dataset_size, kill_tree, parse_ts, plain_batch, strays  # noqa: E402
from tests.emulators.aws import AwsImdsEmulator  # noqa: E402
from tests.harness import memory_root  # noqa: E402
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout  # noqa: E402
from trainguard.checkpoint.interval import AutoSettings, IntervalMode, IntervalPolicy  # noqa: E402
from trainguard.agent.lead import LeadCosts, auto_drain_lead  # noqa: E402
from bench import spotcost  # noqa: E402
from bench import spotsim as sim  # noqa: E402
from trainguard.contract.protocol import STEP_AGREEMENT_PERIOD_S  # noqa: E402

ELASTIC = os.path.join(REPO, "examples", "train_gpt_elastic.py")
PLAIN = os.path.join(REPO, "examples", "train_gpt.py")
GLOBAL_BATCH = 24


TORCH_LAST_CALL_S = RendezvousTimeout().last_call.total_seconds()
"""torch's c10d rendezvous waits this long after a round's first participant for more (30 s by default)
before it completes a round below ``max_nodes`` (``dynamic_rendezvous._RendezvousJoinOp``)."""


def micro_batch(max_agents: int) -> int:
    """The largest micro-batch (<= 4) that splits the global batch evenly at every world size up to
    ``max_agents`` (the global batch stays constant through gradient accumulation)."""
    for m in (4, 3, 2, 1):
        if all(GLOBAL_BATCH % (w * m) == 0 for w in range(1, max_agents + 1)):
            return m
    raise SystemExit(f"--max-agents {max_agents}: no micro-batch splits the global batch {GLOBAL_BATCH} at every size")
FIXED_STEPS = 50
SPOT_PRICE, ON_DEMAND_PRICE = 0.918, 3.06  # p3.2xlarge, us-east-1: on-demand list price; spot ~70 % off (assumed)
MONITOR_INTERVAL = 0.2


class BenchError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------- the schedule
@dataclass(frozen=True, slots=True)
class Action:
    t: float
    kind: str
    """``start``, ``notice`` (serve the spot notice), ``kill`` (the node's time is up)."""
    agent: str
    announced: bool = True


def schedule(scaled: sim.Trace, unannounced: frozenset[int], lead_s: float, notices: bool = True) -> list[Action]:
    out: list[Action] = []
    i = 0
    for e in scaled.events:
        if e.kind == "add":
            out.append(Action(e.t_s, "start", e.node))
            continue
        announced = notices and i not in unannounced
        i += 1
        if announced:
            out.append(Action(max(0.0, e.t_s - lead_s), "notice", e.node))
        out.append(Action(e.t_s, "kill", e.node, announced))
    return sorted(out, key=lambda a: (a.t, a.kind != "kill"))


# ---------------------------------------------------------------------------------------- one replay
@dataclass
class AgentRun:
    name: str
    proc: Proc
    emulator: AwsImdsEmulator | None
    samples_dir: str
    started: float
    notice_at: float | None = None
    killed_at: float | None = None
    exited_at: float | None = None
    exit_code: int | None = None
    metrics_url: str | None = None
    scrape: str = ""
    scrape_at: float = 0.0


@dataclass
class ReplayRaw:
    name: str
    mode: str
    t0: float
    t_end: float = 0.0
    agents: dict[str, AgentRun] = field(default_factory=dict)
    actions: list[Action] = field(default_factory=list)
    lead_s: float = 0.0
    errors: list[str] = field(default_factory=list)


def _scraper(raw: ReplayRaw, stop: threading.Event) -> None:
    """Scrape every live agent's /metrics once a second; keep the last answer (the agents wait for one
    more scrape before they exit, so the last one holds their final values)."""
    while not stop.wait(1.0):
        for a in list(raw.agents.values()):
            if a.metrics_url is None:
                ev = a.proc.events("metrics_serving")
                if ev:
                    a.metrics_url = ev[0][1].get("url")
            if a.metrics_url is None or a.exited_at is not None:
                continue
            try:
                with urllib.request.urlopen(a.metrics_url.rstrip("/") + "/metrics", timeout=2) as r:
                    a.scrape, a.scrape_at = r.read().decode(), time.time()
            except OSError:
                pass


def replay(name: str, mode: str, actions: list[Action], duration_s: float, a: argparse.Namespace, work: str,
           max_agents: int) -> ReplayRaw:
    """Run ``actions`` against real agents (``mode`` ``trainguard`` or ``torchrun``) for ``duration_s``."""
    d = os.path.join(work, name)
    os.makedirs(d)
    store = Proc(f"{name}-store", [sys.executable, "-m", "trainguard.agent.cli", "store", "--host", "127.0.0.1",
                                   "--port", "0", "--log-format", "json"], os.path.join(d, "store.log"))
    raw = ReplayRaw(name, mode, t0=0.0, actions=actions, lead_s=a.lead_s)
    stop = threading.Event()
    scraper = threading.Thread(target=_scraper, args=(raw, stop), name="scraper", daemon=True)
    try:
        deadline = time.monotonic() + 60
        port = None
        while port is None and time.monotonic() < deadline:
            ev = store.events("store_ready")
            port = ev[0][1].get("port") if ev else None
            time.sleep(0.1)
        if port is None:
            raise BenchError(f"the rendezvous store did not start:\n{store.tail()}")
        endpoint = f"127.0.0.1:{port}"
        scraper.start()
        raw.t0 = time.time()
        for act in actions:
            wait = raw.t0 + act.t - time.time()
            if wait > 0:
                time.sleep(wait)
            _act(raw, act, mode, endpoint, a, d, max_agents)
            _reap(raw)
        wait = raw.t0 + duration_s - time.time()
        if wait > 0:
            time.sleep(wait)
        raw.t_end = time.time()
        live = [ag for ag in raw.agents.values() if ag.proc.proc.poll() is None]
        for ag in live:  # the end of the trace: stop (trainguard drains: every step trained is kept)
            ag.proc.proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + 90
        while any(ag.proc.proc.poll() is None for ag in live) and time.monotonic() < end:
            time.sleep(0.2)
            _reap(raw)
        _reap(raw)
    finally:
        stop.set()
        for ag in raw.agents.values():
            ag.proc.kill()
            if ag.emulator is not None:
                ag.emulator.close()
        store.kill()
        for pid in strays(d):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            dump_raw(raw, os.path.join(d, RAW_FILE))
    return raw


RAW_FILE = "replay.json"


def dump_raw(raw: ReplayRaw, path: str) -> None:
    """What the analysis needs besides the logs (``--reanalyse`` reads it back): the schedule, each agent's
    start, notice, kill and exit times, and each log line's arrival time (torchrun's text lines carry none)."""
    agents = {n: {"started": ag.started, "notice_at": ag.notice_at, "killed_at": ag.killed_at,
                  "exited_at": ag.exited_at, "exit_code": ag.exit_code, "samples_dir": ag.samples_dir,
                  "scrape": ag.scrape, "scrape_at": ag.scrape_at,
                  "log": os.path.basename(ag.proc._fh.name), "line_times": [round(t, 4) for t, _ in ag.proc.lines()]}
              for n, ag in raw.agents.items()}
    with open(path, "w") as fh:
        json.dump({"name": raw.name, "mode": raw.mode, "t0": raw.t0, "t_end": raw.t_end, "lead_s": raw.lead_s,
                   "actions": [[x.t, x.kind, x.agent, x.announced] for x in raw.actions], "agents": agents}, fh)


class LoggedProc:
    """A finished agent's log read back from its folder: the :class:`Proc` read interface."""

    def __init__(self, name: str, path: str, times: list[float]) -> None:
        with open(path, errors="replace") as fh:
            text = [line.rstrip("\n") for line in fh]
        self.name, self._lines = name, list(zip(times, text))
        self.proc = type("Done", (), {"poll": staticmethod(lambda: 0), "returncode": 0, "pid": -1})()

    events = Proc.events
    lines = Proc.lines
    _lock = contextlib.nullcontext()


def load_raw(folder: str) -> ReplayRaw:
    """A replay run kept with ``--keep`` (its folder holds ``replay.json``), for ``--reanalyse``."""
    with open(os.path.join(folder, RAW_FILE)) as fh:
        d = json.load(fh)
    raw = ReplayRaw(d["name"], d["mode"], d["t0"], d["t_end"], lead_s=d["lead_s"],
                    actions=[Action(t, k, ag, bool(an)) for t, k, ag, an in d["actions"]])
    for n, a in d["agents"].items():
        proc = LoggedProc(n, os.path.join(folder, a["log"]), a["line_times"])
        raw.agents[n] = AgentRun(n, proc, None, a["samples_dir"], a["started"],  # type: ignore[arg-type]
                                 a["notice_at"], a["killed_at"], a["exited_at"], a["exit_code"], None, a["scrape"],
                                 a["scrape_at"])
    return raw


def _reap(raw: ReplayRaw) -> None:
    for ag in raw.agents.values():
        if ag.exited_at is None and ag.proc.proc.poll() is not None:
            ag.exit_code = ag.proc.proc.returncode
            # When it exited, by its own last word if it had one (this is polled only now and then).
            exits = [parse_ts(ev) for _, ev in ag.proc.events("agent_exit")]
            ag.exited_at = exits[-1] if exits and exits[-1] else time.time()


def _act(raw: ReplayRaw, act: Action, mode: str, endpoint: str, a: argparse.Namespace, d: str, max_agents: int) -> None:
    t = time.time()
    if act.kind == "start":
        raw.agents[act.agent] = _start(act.agent, mode, endpoint, a, d, max_agents)
        return
    ag = raw.agents.get(act.agent)
    if ag is None:
        return
    if act.kind == "notice":
        ag.notice_at = t
        if ag.emulator is not None:
            ag.emulator.schedule_termination(in_s=a.lead_s)
        return
    _reap(raw)
    if ag.proc.proc.poll() is None:  # the node's time is up: whatever is left of it goes
        ag.killed_at = t
        kill_tree(ag.proc.proc.pid)


def _start(agent: str, mode: str, endpoint: str, a: argparse.Namespace, d: str, max_agents: int) -> AgentRun:
    samples = os.path.join(d, "samples", agent)
    os.makedirs(samples)
    nnodes = f"1:{max_agents}"
    if mode == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "bench", "--rdzv-conf", "is_host=0",
               "--max-restarts", "1000", "--local-addr", "127.0.0.1", "--monitor-interval", str(MONITOR_INTERVAL),
               PLAIN, "--steps", "1000000000", "--ckpt-dir", os.path.join(d, "ckpt"), "--ckpt-every", str(FIXED_STEPS),
               "--global-batch", str(GLOBAL_BATCH), "--step-sleep", str(a.step_sleep), "--log-every", "1",
               *model_args(a)]
        # torch 2.13 needs this for a scale-up to work at all (see bench/recovery.py, agent/supervisor.py).
        proc = Proc(agent, cmd, os.path.join(d, f"{agent}.log"), {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
        return AgentRun(agent, proc, None, samples, time.time())
    emu = AwsImdsEmulator()
    interval = ["--set", "checkpoint.interval=auto", "--set", f"checkpoint.interval_min_s={a.auto_min_s}",
                "--set", f"checkpoint.interval_prior_mtbf_s={a.prior_mtbf_s / a.speed:g}",
                "--set", f"checkpoint.interval_max_s={3600 / a.speed:g}"] if mode.startswith("trainguard-auto") \
        else ["--set", f"checkpoint.interval={FIXED_STEPS}"]
    if mode == "trainguard-auto-drain":  # the notice policy before 2026-11-26: drain at every notice at once
        interval += ["--set", "preemption.train_through_notice=false"]
    if mode == "trainguard-auto-notier0":  # the default before 2026-11-27: no in-memory snapshots (tier 0 off)
        interval += ["--set", "checkpoint.memory_interval_steps=0"]
    cmd = [sys.executable, "-m", "trainguard.agent.cli", "run", "--nnodes", nnodes, "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "bench", "--node-name", agent,
           "--local-addr", "127.0.0.1", "--monitor-interval", str(MONITOR_INTERVAL),
           "--state-dir", os.path.join(d, f"state-{agent}"), "--log-dir", os.path.join(d, f"logs-{agent}"),
           "--set", "agent.log_format=json", "--set", "metrics.port=0", "--set", "metrics.sample_interval_s=0.5",
           "--set", "rendezvous.is_host=false", "--set", "preemption.sources=aws,signal",
           "--set", f"preemption.aws_endpoint={emu.url}", "--set", "preemption.poll_interval_s=0.5",
           "--set", "workers.max_restarts=1000", "--set", f"cost.spot_price_per_hour={SPOT_PRICE}",
           "--set", f"checkpoint.url={store_url(d, a)}", *interval,
           "--set", f"checkpoint.memory_dir={memory_root(d)}",  # tier 0 (on by default): this run's own folder
           ELASTIC, "--steps", "1000000000", "--log-every", "1000000", "--step-sleep", str(a.step_sleep),
           "--global-batch", str(GLOBAL_BATCH), "--micro-batch", str(micro_batch(max_agents)), "--sample-log", samples,
           *model_args(a)]
    return AgentRun(agent, Proc(agent, cmd, os.path.join(d, f"{agent}.log"), store_env(a)), emu, samples, time.time())


THROTTLED_STORE = os.path.join(REPO, "bench", "throttled_store")


def model_args(a: argparse.Namespace) -> list[str]:
    """The bundled model's size options (``--d-model``, ``--layers``), when the bench sets them."""
    return [*(["--d-model", str(a.d_model)] if a.d_model else []), *(["--layers", str(a.layers)] if a.layers else [])]


def store_url(d: str, a: argparse.Namespace) -> str:
    """The run's checkpoint store: a local folder (bandwidth-limited with ``--store-bytes-per-s``: see
    :func:`store_env`)."""
    return os.path.join(d, "ckpt")


def store_env(a: argparse.Namespace) -> dict[str, str]:
    """With ``--store-bytes-per-s``: the environment that throttles fsspec's local files in the agents and
    their workers (``bench/throttled_store/sitecustomize.py``), each process at that many bytes/s."""
    if not a.store_bytes_per_s:
        return {}
    path = os.pathsep.join(p for p in (THROTTLED_STORE, os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "TG_BENCH_STORE_BYTES_PER_S": f"{a.store_bytes_per_s:g}"}


# ---------------------------------------------------------------------------------------- analysis
@dataclass(slots=True)
class Exec:
    """One execution of one step by one rank (trainguard), or by the world (torchrun rank 0 x world)."""

    agent: str
    step: int
    rank: int
    world: int
    t0: float
    t1: float
    ids: tuple[int, ...] = ()
    round: Any = None  # the rendezvous round of the attempt (sample log); None: torchrun's rank-0 events

    def attempt(self) -> tuple[Any, ...]:
        """The attempt this record belongs to: (step, round) in the sample log, where every rank of
        the world writes one record per attempt; each torchrun event is an attempt of its own."""
        return (self.step, self.round) if self.round is not None else (self.step, self.agent, self.t1)


def leads(execs: list[Exec]) -> list[Exec]:
    """One record per attempt: its lowest rank's. Not always rank 0's: a rank 0 killed mid-step
    never writes the step a survivor finished and handed over to the re-formed world."""
    by: dict[tuple[Any, ...], Exec] = {}
    for e in execs:
        k = e.attempt()
        if k not in by or e.rank < by[k].rank:
            by[k] = e
    return sorted(by.values(), key=lambda e: (e.t1, e.rank))


def executions(raw: ReplayRaw) -> list[Exec]:
    """Every completed attempt of a step (attempts a vanished peer interrupted, ``rolled_back`` in the
    sample log of an in-place run, are void: see ``tests/samples.py``)."""
    out: list[Exec] = []
    void: set[tuple[int, Any]] = set()
    for ag in raw.agents.values():
        if raw.mode == "torchrun":
            for t, ev in ag.proc.events("train_step"):
                t1 = float(ev.get("t") or t)
                out.append(Exec(ag.name, int(ev["step"]), 0, int(ev["world_size"]), t1 - float(ev["step_s"]), t1))
            continue
        for fname in sorted(os.listdir(ag.samples_dir)):
            with open(os.path.join(ag.samples_dir, fname)) as fh:
                for line in fh:
                    with contextlib.suppress(ValueError, KeyError):
                        r = json.loads(line)
                        if r.get("rolled_back"):  # a vanished peer interrupted this attempt: void everywhere
                            void.add((int(r["step"]), r.get("round")))
                            continue
                        out.append(Exec(ag.name, int(r["step"]), int(r["rank"]), int(r["world_size"]), float(r["t0"]),
                                        float(r["t1"]), tuple(r["ids"]), r.get("round")))
    out = [e for e in out if (e.step, e.round) not in void]
    return sorted(out, key=lambda e: (e.t1, e.rank))


def lineage(execs: list[Exec]) -> tuple[list[Exec], int]:
    """The executions that end up in the final model, and its last step. The final model is what the
    world that trained last ends with; each of its steps was kept in its last attempt (a rollback
    re-trains a step later, never earlier): that attempt's lead record (:func:`leads`) and the other
    ranks' records of the same attempt."""
    lead = leads(execs)
    if not lead:
        return [], 0
    final = max(lead, key=lambda e: e.t1).step
    last: dict[int, Exec] = {}
    for e in lead:
        if e.step <= final and (e.step not in last or e.t1 >= last[e.step].t1):
            last[e.step] = e
    kept_attempts = {e.attempt() for e in last.values()}
    kept = list(last.values())
    for e in execs:
        if e.round is not None and e.attempt() in kept_attempts and e is not last[e.step]:
            kept.append(e)
    return sorted(kept, key=lambda e: (e.t1, e.rank)), final


def available_node_s(raw: ReplayRaw, scaled: sim.Trace) -> float:
    return scaled.available_node_s()


def analyse(raw: ReplayRaw, scaled: sim.Trace, max_nodes: int | None = None) -> dict[str, Any]:
    execs = executions(raw)
    kept, final = lineage(execs)
    torchrun = raw.mode == "torchrun"
    weight = (lambda e: e.world) if torchrun else (lambda e: 1)  # torchrun: rank 0's record stands for the world
    productive = sum((e.t1 - e.t0) * weight(e) for e in kept)
    all_node_s = sum((e.t1 - e.t0) * weight(e) for e in execs)
    available = available_node_s(raw, scaled)
    res: dict[str, Any] = {"mode": raw.mode, "final_step": final, "available_node_s": available,
                           "productive_node_s": productive, "ettr": productive / available if available else 0.0,
                           "recomputed_node_s": all_node_s - productive}
    rank0 = leads(execs)  # one record per attempt (rank 0's, or the lowest surviving rank's)
    lead_ids = {id(e) for e in rank0}
    kept0 = [e for e in kept if id(e) in lead_ids]
    res["lost_steps"] = len(rank0) - len(kept0)
    res["samples_per_step"] = GLOBAL_BATCH
    res["committed_samples"] = final * GLOBAL_BATCH
    res["cost_total"] = available / 3600 * SPOT_PRICE
    res["cost_per_sample"] = res["cost_total"] / res["committed_samples"] if final else None
    node_s_per_step = sum((e.t1 - e.t0) * e.world for e in kept0) / len(kept0) if kept0 else None
    res["on_demand_cost_per_sample"] = (node_s_per_step / 3600 * ON_DEMAND_PRICE / GLOBAL_BATCH) if node_s_per_step else None
    by_size: dict[int, float] = collections.defaultdict(float)
    step_s: dict[int, list[float]] = collections.defaultdict(list)
    for e in rank0:
        by_size[e.world] += e.t1 - e.t0
        step_s[e.world].append(e.t1 - e.t0)
    res["training_s_by_world_size"] = {str(k): round(v, 3) for k, v in sorted(by_size.items())}
    res["step_s_by_world_size"] = {str(k): round(statistics.median(v), 4) for k, v in sorted(step_s.items())}
    res["step_s_mean_by_world_size"] = {str(k): round(statistics.fmean(v), 5) for k, v in sorted(step_s.items())}
    res["step_overhead_s"], res["between_steps_node_s"] = _between_steps(raw, rank0)
    res["in_place"] = any(ag.proc.events("reformed_in_place") for ag in raw.agents.values())
    # Survivors of an abandoned emergency checkpoint re-formed in place (the runtime since 2026-11-29), or
    # every worker exited and the world restarted from storage (before: the replays' JSON lacks the key).
    abandoned = _events(raw, "checkpoint_abandoned")
    res["abandon_in_place"] = all(ev.get("in_place") for _, _, ev in abandoned) if abandoned else True
    res["abandoned_checkpoints"] = len({(ev.get("step"), ev.get("kind")) for _, _, ev in abandoned})
    # Samples of the final lineage against the stream the job should have read.
    n = dataset_size()
    if torchrun:
        cache: dict[int, list[int]] = {}
        used = [i for e in kept0 for i in plain_batch(e.step, n, cache)]
        expected = [i for s in range(1, final + 1) for i in plain_batch(s, n, cache)]
    else:
        # Records carry each rank's share of the batch, or (in-place runs) the whole global batch on
        # every rank: then rank 0's records are the lineage.
        whole = kept0 and all(len(e.ids) == GLOBAL_BATCH for e in kept0)
        used, expected = [i for e in (kept0 if whole else kept) for i in e.ids], cursor_stream(final, n)
    # As multisets: a long run reads the dataset more than once (epochs), each time every id once.
    seen, want = collections.Counter(used), collections.Counter(expected)
    res["skipped_samples"] = sum((want - seen).values())
    res["repeated_samples"] = sum((seen - want).values())
    res["world_timeline"] = _timeline(rank0, kept0, raw.t0)
    res["changes"], res["measured_costs"] = _changes(raw, rank0, kept0, max_nodes)
    res["interval_changes"] = [{"t": round((parse_ts(ev) or t) - raw.t0, 3), **{k: ev.get(k) for k in
                                ("old_s", "new_s", "optimum_s", "reason", "bound", "save_cost_s", "mtbf_s",
                                 "rollback_probability", "unannounced_failures", "survived_losses")}}
                               for ag in raw.agents.values() for t, ev in ag.proc.events("checkpoint_interval_changed")]
    res["interval_changes"].sort(key=lambda x: x["t"])
    res["periodic_saves"] = len({ev.get("step") for ag in raw.agents.values() for _, ev in ag.proc.events("checkpoint_committed")
                                 if ev.get("kind") == "periodic" and ev.get("component") == "trainguard.checkpoint"})
    res["agents"] = {ag.name: _agent_truth(ag, kept, raw) for ag in raw.agents.values()}
    res["checkpoint_bytes"] = checkpoint_bytes(raw)
    res["waste_by_cause"] = measured_waste(raw, res)
    return res


def checkpoint_bytes(raw: ReplayRaw) -> int | None:
    """Bytes of the largest committed checkpoint step the run left in its store (the whole job's
    state, every shard; None when the store is gone)."""
    folders = {os.path.dirname(os.path.dirname(ag.samples_dir)) for ag in raw.agents.values()}
    sizes = []
    for d in folders:
        for root, dirs, files in os.walk(os.path.join(d, "ckpt")):
            if os.path.basename(root).startswith("step-") and "manifest.json" in files:
                sizes.append(sum(os.path.getsize(os.path.join(root, f)) for f in files))
    return max(sizes) if sizes else None


def _between_steps(raw: ReplayRaw, rank0: list[Exec]) -> tuple[float, float]:
    """The time between two consecutive steps of a world outside the steps themselves (the runtime's
    per-step work: data, hooks, logging): the mean gap after steps that took no periodic save, over gaps
    with no re-formation in them (under 1 s); and the node-seconds all such gaps took (saves included)."""
    saved = {(int(e.get("step", -1)), e.get("world_size")) for _, _, e in
             _events(raw, "checkpoint_staged", lambda e: e.get("kind") == "periodic")}
    rdzv = [t for t, _, _ in _events(raw, "rendezvous_complete")]
    plain, node_s = [], 0.0
    for a, b in zip(rank0, rank0[1:]):
        gap = b.t0 - a.t1
        if not 0 <= gap < 1.0 or a.world != b.world or a.step + 1 != b.step:
            continue
        k = bisect.bisect_left(rdzv, a.t1)
        if k < len(rdzv) and rdzv[k] <= b.t0:
            continue
        node_s += gap * a.world
        if (a.step, a.world) not in saved:
            plain.append(gap)
    return (statistics.fmean(plain) if plain else 0.0), node_s


def _timeline(rank0: list[Exec], kept0: list[Exec], t0: float) -> dict[str, list[float]]:
    """World size and cumulative useful (kept) steps over time, for the plot."""
    kept_t = sorted(e.t1 for e in kept0)
    pts = {"t": [], "world": [], "useful_steps": []}
    for e in rank0:
        pts["t"].append(round(e.t1 - t0, 3))
        pts["world"].append(e.world)
        pts["useful_steps"].append(bisect.bisect_right(kept_t, e.t1))
    return pts


def _events(raw: ReplayRaw, name: str, pred: Any = None) -> list[tuple[float, str, dict[str, Any]]]:
    out = []
    for ag in raw.agents.values():
        for t, ev in ag.proc.events(name):
            if pred is None or pred(ev):
                out.append((parse_ts(ev) or t, ag.name, ev))
    return sorted(out, key=lambda x: x[0])


def _first_after(items: list[tuple[float, str, dict[str, Any]]], t: float, until: float = float("inf")) -> float | None:
    for ts, _, _ in items:
        if t <= ts <= until:
            return ts
    return None


def _last_in(items: list[tuple[float, str, dict[str, Any]]], t: float, until: float) -> float | None:
    found = [ts for ts, _, _ in items if t <= ts <= until]
    return max(found) if found else None


def _gaps(steps: list[Exec]) -> list[tuple[float, float, Exec, Exec]]:
    """Times the world did not train: ``(last step end, next step start, last, next)`` for pauses longer
    than ``max(1 s, 5 x the median step)`` (a periodic save's blocking is shorter)."""
    if len(steps) < 2:
        return []
    med = statistics.median(e.t1 - e.t0 for e in steps)
    out = []
    for prev, nxt in zip(steps, steps[1:]):
        if nxt.t0 - prev.t1 > max(1.0, 5 * med):
            out.append((prev.t1, nxt.t0, prev, nxt))
    return out


def _text_times(raw: ReplayRaw, needle: str) -> list[tuple[float, str, dict[str, Any]]]:
    """Arrival times of plain log lines containing ``needle`` (torchrun logs text, not JSON)."""
    return sorted((t, ag.name, {}) for ag in raw.agents.values() for t, line in ag.proc.lines() if needle in line)


def _changes(raw: ReplayRaw, rank0: list[Exec], kept0: list[Exec],
             max_nodes: int | None = None) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    """Per membership change (the actions of one instant): the world's pause around it and its phases,
    from the agents' and workers' events. A change whose pause runs into the next change is reported as
    ``overlapped`` and left out of the cost distributions (the simulator models overlap itself)."""
    t0, lead = raw.t0, raw.lead_s
    steps = sorted(rank0, key=lambda e: e.t1)
    gaps = _gaps(steps)
    kept_ids = {id(e) for e in kept0}
    groups: list[list[Action]] = []
    for act in raw.actions:
        if act.kind == "notice":
            continue
        if groups and abs(groups[-1][0].t - act.t) < 1e-6 and groups[-1][0].kind == act.kind \
                and groups[-1][0].announced == act.announced:
            groups[-1].append(act)
        else:
            groups.append([act])
    torchrun = raw.mode == "torchrun"
    tg_ev = _TgEvents(raw)
    ckpt = _events(raw, "checkpoint_committed", lambda e: e.get("component") == "trainguard.worker")
    rdzv = _events(raw, "rendezvous_complete")
    failed = _events(raw, "state_change", lambda e: e.get("new") == "restarting")
    resize_req = _events(raw, "resize_requested_from_workers")
    formed = _events(raw, "world_formed")  # torchrun's rank 0 once its process group exists
    if torchrun:
        failed = _text_times(raw, "failed (exitcode")
        resize_req = _text_times(raw, "new nodes")
    staged = _events(raw, "checkpoint_staged", lambda e: e.get("kind") == "periodic")
    committed = _events(raw, "checkpoint_committed",
                        lambda e: e.get("kind") == "periodic" and e.get("component") == "trainguard.checkpoint")

    def ref(g: list[Action]) -> float:
        """When the world can first react to the change: the notice, else the action itself."""
        return t0 + g[0].t - (lead if g[0].kind == "kill" and g[0].announced else 0.0)

    costs: dict[str, list[float]] = collections.defaultdict(list)
    out: list[dict[str, Any]] = []
    prev_end = t0
    for gi, g in enumerate(groups):
        act = g[0]
        kind = ("start" if act.t == 0 else "join") if act.kind == "start" else ("notice" if act.announced else "kill")
        rec: dict[str, Any] = {"t": round(act.t, 3), "kind": kind, "agents": [x.agent for x in g]}
        out.append(rec)
        if kind == "start" and torchrun:
            if steps:  # torchrun logs no rendezvous: agent start to the first step, warm-up included
                rec["first_step_s"] = rec["startup_s"] = round(steps[0].t0 - (t0 + act.t), 3)
                costs["startup_s"].append(steps[0].t0 - (t0 + act.t))
                costs["reformation_s"].append(0.0)
                prev_end = steps[0].t0
            continue
        if kind == "start":
            if steps:
                # agent start -> rendezvous complete -> first step: rendezvous, then the workers' start-up
                # (process start, imports, model build, restore); the last rendezvous before the first
                # step, when a change during the start-up restarted it.
                t_r = _last_in(rdzv, t0, steps[0].t0)
                rec["first_step_s"] = round(steps[0].t0 - (t0 + act.t), 3)
                if t_r is not None:
                    costs["startup_s"].append(steps[0].t0 - t_r)
                    rec["startup_s"] = round(steps[0].t0 - t_r, 3)
                # The first round: the last of its nodes waiting in the rendezvous until it completes.
                first = tg_ev.rounds[0] if tg_ev.rounds else None
                ready = [min((parse_ts(e) or t for t, e in raw.agents[x.agent].proc.events("state_change")
                              if e.get("new") == "rendezvous"), default=math.inf) for x in g]
                if first and ready and first[0] >= max(ready):
                    costs["start_reformation_s"].append(first[0] - max(ready))
                    rec["rendezvous_s"] = round(first[0] - max(ready), 3)
                    tg_ev.claimed.add(first[1])
            continue
        t_ref = ref(g)
        nxt = ref(groups[gi + 1]) if gi + 1 < len(groups) else float("inf")
        if not torchrun:
            prev_end = _tg_change(rec, t0 + act.t, t_ref, nxt, prev_end, steps, kept_ids, tg_ev, costs)
            continue
        # The pause this change caused: after a notice or a join the world stops after it; a kill hits
        # the world mid-step (the pause starts at most one step before it).
        lo, hi = {"kill": (t_ref - 5.0, t_ref + 2.0), "notice": (t_ref, t_ref + lead + 10.0),
                  "join": (t_ref, t_ref + 60.0)}[kind]
        gap = next(((a, b, pe, ne) for a, b, pe, ne in gaps if b > t_ref and max(prev_end, lo) <= a <= hi), None)
        if gap is None:  # absorbed by the re-formation under way (e.g. a join during the start-up)
            rec["absorbed"] = True
            continue
        t_last, t_first, last, first = gap
        rec.update(world_before=last.world, world_after=first.world, down_s=round(t_first - t_last, 3),
                   overlapped=t_first > nxt)
        phases: dict[str, float] = {}
        if torchrun:  # text logs: detection when torchrun reports the failed worker; re-formation until
            # the restarted rank 0 has its process group (torchrun's rendezvous waits out its last call
            # there, and joiners arriving meanwhile join the same round); restore (model build,
            # torch.load) until the first step.
            t_det = _first_after(failed, t0 + act.t, t_first) if kind == "kill" else None
            t_from = t_det or (t0 + act.t if kind == "kill" else t_last)
            t_up = _last_in(formed, t_from, t_first) or t_from
            if t_det:
                phases["detect_failure_s"] = t_det - (t0 + act.t)
            prefix = "failure_" if kind == "kill" else "join_"
            phases[f"{prefix}reformation_s"] = t_up - t_from
            if max_nodes and first.world < max_nodes:  # its round waited out torch's last call (the simulator
                # adds that wait itself to any round below max_nodes): the cost of the rest
                rec["last_call_s"] = TORCH_LAST_CALL_S
                phases[f"{prefix}reformation_s"] = max(0.0, t_up - t_from - TORCH_LAST_CALL_S)
            phases[f"{prefix}restore_s"] = t_first - t_up
            lost = [e for e in steps if prev_end <= e.t1 <= t_last and id(e) not in kept_ids]
            rec["recomputed_steps"] = len(lost)
            rec["recompute_node_s"] = round(sum((e.t1 - e.t0) * e.world for e in lost), 3)
        elif kind == "notice":
            t_commit = _last_in(ckpt, t_last, t_first)
            t_r = _last_in(rdzv, t_commit or t_last, t_first)
            phases["detect_notice_s"] = max(0.0, t_last - t_ref)
            if t_commit:
                phases["emergency_s"] = t_commit - t_last
            if t_commit and t_r:
                phases["reformation_s"] = t_r - t_commit
            if t_r:
                phases["restore_s"] = t_first - t_r
        else:
            t_act = t0 + act.t
            t_det = _first_after(resize_req if kind == "join" else failed, t_act, t_first)
            t_commit = _last_in(ckpt, t_last, t_first) if kind == "join" else None
            t_up = _last_in(rdzv, t_commit or t_det or t_act, t_first)
            if t_det and kind == "kill":
                phases["detect_failure_s"] = t_det - t_act
            if t_det and kind == "join":
                rec["join_noticed_s"] = round(t_det - t_act, 3)
            if t_commit:
                phases["resize_checkpoint_s"] = t_commit - t_last
            if t_up and (t_commit or t_det):
                phases["reformation_s"] = t_up - (t_commit or t_det)
            if t_up:
                phases["restore_s"] = t_first - t_up
            # Steps trained since the previous pause that the final model does not keep: rolled back.
            lost = [e for e in steps if prev_end <= e.t1 <= t_last and id(e) not in kept_ids]
            rec["recomputed_steps"] = len(lost)
            rec["recompute_node_s"] = round(sum((e.t1 - e.t0) * e.world for e in lost), 3)
        prev_end = t_first
        rec["phases"] = {k: round(v, 3) for k, v in phases.items()}
        for k, v in phases.items():
            if v >= 0:  # overlapped changes only fill in what no clean change measured (see measured_costs)
                costs[k if not rec["overlapped"] else f"overlapped:{k}"].append(v)
    # Warm-up: an agent's start until it waits in the rendezvous (a node of the first world:
    # agent_start_s), or until its workers are warm in standby (a node joining a running world).
    first_step = steps[0].t0 if steps else float("inf")
    for ag in raw.agents.values():
        if torchrun:
            break
        warm = [parse_ts(e) or t for t, e in ag.proc.events("joiner_warm")]
        ready = [parse_ts(e) or t for t, e in ag.proc.events("state_change") if e.get("new") == "rendezvous"]
        if warm:
            costs["warmup_s"].append(max(0.0, warm[0] - ag.started))
        elif ready:
            costs["agent_start_s" if ag.started < first_step else "warmup_s"].append(max(0.0, ready[0] - ag.started))
    if torchrun:  # torchrun logs no JSON: its join is seen when the world notices the waiting node
        costs.pop("warmup_s", None)
    for _, _, ev in staged:
        costs["periodic_overhead_s"].append(float(ev.get("blocked_s", 0.0)))
    for _, _, ev in committed:
        if ev.get("persist_s") is not None:
            costs["periodic_persist_s"].append(float(ev["persist_s"]))
    return out, {k: [round(x, 4) for x in v] for k, v in costs.items()}


class _TgEvents:
    """The agents' events a trainguard change is measured by, each ``(time, agent, event)`` in time order."""

    def __init__(self, raw: ReplayRaw) -> None:
        self.rdzv = _events(raw, "rendezvous_complete")
        # Each round: when it completed first, and the agents in it.
        rounds: dict[Any, tuple[float, set[str]]] = {}
        for t, agent, e in self.rdzv:
            t_first, members = rounds.setdefault(e.get("round"), (t, set()))
            members.add(agent)
        self.rounds = sorted((t, r, members) for r, (t, members) in rounds.items())
        self.claimed: set[Any] = set()
        self.commit = _events(raw, "checkpoint_committed", lambda e: e.get("component") == "trainguard.worker"
                              and e.get("kind") in ("emergency", "resize"))
        self.resize = _events(raw, "resize_requested_from_workers")
        self.scheduled = _events(raw, "scheduled_drain")  # train_through_notice: the drain the lead before the end
        # An emergency checkpoint still running at the drain deadline: every worker exits, the world
        # restarts from the newest commit in storage (workers restored with source "storage").
        self.abandoned = _events(raw, "checkpoint_abandoned")
        self.from_storage = _events(raw, "worker_restored", lambda e: e.get("source") == "storage")
        self.react = sorted(_events(raw, "decision", lambda e: e.get("act") in ("reform", "restart"))
                            + _events(raw, "state_change", lambda e: e.get("new") == "restarting"), key=lambda x: x[0])


def _tg_change(rec: dict[str, Any], t_act: float, t_ref: float, nxt: float, prev_end: float, steps: list[Exec],
               kept_ids: set[int], ev: _TgEvents, costs: dict[str, list[float]]) -> float:
    """One trainguard membership change, by its re-formation: the first round completed after the world
    could react (``t_ref``) that the joiner is in, or the leaver is not. Its pause is the gap between the
    steps around that rendezvous; a change whose round an earlier change's already was had its round
    merged into that one (``merged``: no costs of its own). Returns the end of the pause."""
    kind = rec["kind"]
    agents = set(rec["agents"])
    fits = (lambda m: agents <= m) if kind == "join" else (lambda m: not agents & m)
    before = [m for t, _, m in ev.rounds if t < t_ref]
    if kind != "join" and not (before and agents & before[-1]):  # it left before it ever joined the world
        rec["not_in_world"] = True
        return prev_end
    found = next(((t, r) for t, r, m in ev.rounds if t >= t_ref and fits(m)), None)
    if found is None or found[1] in ev.claimed:  # no round of its own (the end of the trace), or merged
        rec["merged" if found is not None else "absorbed"] = True
        return prev_end
    t_r = found[0]
    ev.claimed.add(found[1])
    rec["round"] = found[1]
    i = bisect.bisect_left([e.t0 for e in steps], t_r)
    first = steps[i] if i < len(steps) else None
    last = steps[i - 1] if i > 0 else None
    if first is None:
        rec["absorbed"] = True
        return prev_end
    t_first = first.t0
    t_last = last.t1 if last is not None else None  # None: before the first step (the start-up restarted)
    rec.update(world_before=last.world if last else 0, world_after=first.world, overlapped=t_first > nxt,
               down_s=round(t_first - t_last, 3) if t_last is not None else None)
    phases: dict[str, float] = {}
    if kind == "notice":
        t_stop = t_last if t_last is not None else t_ref
        t_commit = _last_in(ev.commit, t_stop, t_r)
        t_sched = _last_in(ev.scheduled, t_ref, t_stop)  # trained through the notice: the drain began here
        phases["detect_notice_s"] = max(0.0, t_stop - (t_sched or t_ref))
        if t_sched is not None:
            rec["trained_through_s"] = round(t_sched - t_ref, 3)
        if t_commit:
            phases["emergency_s"] = t_commit - t_stop
        phases["reformation_s"] = t_r - (t_commit or t_stop)
        restore = "restore_s"
    elif kind == "join":
        t_det = _first_after(ev.resize, t_act, t_r) or t_act
        t_commit = _last_in(ev.commit, max(t_det, t_last or t_det), t_r)
        t_stop = max(t_det, t_last) if t_last is not None else t_det
        if t_commit:
            phases["resize_checkpoint_s"] = t_commit - t_stop
        phases["join_reformation_s"] = t_r - (t_commit or t_stop)
        rec["join_noticed_s"] = round(t_det - t_act, 3)
        restore = "join_restore_s"
    else:
        t_det = _first_after(ev.react, t_act, t_r)
        if t_det is not None:
            phases["detect_failure_s"] = t_det - t_act
            phases["failure_reformation_s"] = t_r - t_det
        restore = "failure_restore_s"
    t_gave_up = _last_in(ev.abandoned, t_last, t_r) if t_last is not None else None
    if t_gave_up is not None and _first_after(ev.from_storage, t_r, t_first) is not None:
        # The world restarted from storage after an abandoned emergency checkpoint (this notice's, or
        # one this join was merged into): the simulator's storage restore, not an in-place one.
        rec["from_storage"] = True
        restore = "storage_restore_s"
        if kind == "notice":
            phases.pop("reformation_s", None)
            phases["failure_reformation_s"] = t_r - t_gave_up  # the sim detects, then re-forms
        elif kind == "join":
            phases.pop("join_reformation_s", None)
    if t_last is not None:
        phases[restore] = t_first - t_r
        lost = [e for e in steps if prev_end <= e.t1 <= t_last and id(e) not in kept_ids]
        rec["recomputed_steps"] = len(lost)
        rec["recompute_node_s"] = round(sum((e.t1 - e.t0) * e.world for e in lost), 3)
    else:
        rec["during_start_up"] = True  # the start-up that follows is the start's (startup_s)
    rec["phases"] = {k: round(v, 3) for k, v in phases.items()}
    for k, v in phases.items():
        if v >= 0:  # overlapped changes only fill in what no clean change measured (see measured_costs)
            costs[k if not rec["overlapped"] else f"overlapped:{k}"].append(v)
    return max(prev_end, t_first)


def measured_waste(raw: ReplayRaw, res: dict[str, Any]) -> dict[str, float]:
    """Node-seconds lost by cause in the replay: the changes' phases x the nodes that waited, the
    drained nodes' unused notice lead, periodic saves' blocking and the recomputed steps; ``other`` is
    what none of these explains (mostly pauses where changes overlapped)."""
    w: dict[str, float] = collections.defaultdict(float)
    causes = {"emergency_s": "checkpoint", "resize_checkpoint_s": "checkpoint", "warmup_s": "warmup",
              "detect_failure_s": "detection", "reformation_s": "reformation", "restore_s": "restore",
              "join_reformation_s": "reformation", "failure_reformation_s": "reformation",
              "join_restore_s": "restore", "failure_restore_s": "restore", "storage_restore_s": "restore"}
    for c in res["changes"]:
        wb, wa = c.get("world_before") or 0, c.get("world_after") or 0
        for k, v in c.get("phases", {}).items():
            nodes = {"emergency_s": wb, "resize_checkpoint_s": wb, "warmup_s": len(c["agents"])}.get(k, wa)
            if k in causes:
                w[causes[k]] += v * nodes
        if "startup_s" in c:
            w["restore"] += c["startup_s"] * len(c["agents"])
        if "rendezvous_s" in c:
            w["reformation"] += c["rendezvous_s"] * len(c["agents"])
        w["reformation"] += c.get("last_call_s", 0.0) * wa  # taken out of its phase for the simulator's costs
    w["warmup"] += sum(res["measured_costs"].get("warmup_s", [])) + sum(res["measured_costs"].get("agent_start_s", []))
    # The gaps between steps (periodic saves' blocking included: it is taken out below).
    w["between_steps"] = res.get("between_steps_node_s", 0.0)
    w["recompute"] = res["recomputed_node_s"]
    w["periodic_checkpoint"] = sum(res["measured_costs"].get("periodic_overhead_s", []))
    w["between_steps"] = max(0.0, w["between_steps"] - w["periodic_checkpoint"])
    for ag in raw.agents.values():
        if ag.notice_at is not None and ag.exited_at is not None:
            reclaim = max((x.t for x in raw.actions if x.agent == ag.name and x.kind == "kill"), default=None)
            if reclaim is not None:
                w["notice_lead"] += max(0.0, min(raw.t_end, raw.t0 + reclaim) - ag.exited_at)
    explained = sum(w.values())
    w["other"] = res["available_node_s"] - res["productive_node_s"] - explained
    return {k: round(v, 3) for k, v in sorted(w.items())}


def _metric(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    total, found = 0.0, False
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                total += s.value
                found = True
    return total if found else None


def _agent_truth(ag: AgentRun, kept: list[Exec], raw: ReplayRaw) -> dict[str, Any]:
    """The agent's exported goodput and cost next to the ground truth from its workers' step timestamps."""
    out: dict[str, Any] = {"started": round(ag.started - raw.t0, 3),
                           "ended": round((ag.exited_at or raw.t_end) - raw.t0, 3),
                           "end": "killed" if ag.killed_at else ("drained" if ag.notice_at else "stopped"),
                           "exit_code": ag.exit_code}
    if not ag.scrape or raw.mode == "torchrun":
        return out
    start = _metric(ag.scrape, "trainguard_agent_start_time_seconds")
    stops = [parse_ts(ev) for _, ev in ag.proc.events("state_change") if ev.get("new") in ("stopped", "succeeded", "failed")]
    stop = stops[-1] if stops and stops[-1] else None
    mine = [e for e in kept if e.agent == ag.name]
    out["metric_goodput"] = _metric(ag.scrape, "trainguard_goodput_ratio")
    out["metric_paid_s"] = _metric(ag.scrape, "trainguard_paid_seconds_total")
    out["metric_cost_total"] = _metric(ag.scrape, "trainguard_cost_total")
    out["metric_cost_wasted"] = _metric(ag.scrape, "trainguard_cost_wasted_total")
    out["metric_wasted_s"] = {r: _metric(ag.scrape, "trainguard_wasted_seconds_total", {"reason": r})
                              for r in ("startup", "drain", "resize", "restart", "recompute", "checkpoint", "other")}
    out["final_scrape"] = stop is not None and ag.scrape_at >= stop
    if start and mine:  # the agent's start to its workers' first step: paid, not productive
        out["truth_first_step_s"] = round(min(e.t0 for e in mine) - start, 3)
    if start and stop and not ag.killed_at:
        # The truth at the instant the metric was read: the stop, or the last scrape when it came before
        # (the agent's last second or so then counts in neither).
        at = stop if out["final_scrape"] else ag.scrape_at
        out["truth_at"] = "stop" if out["final_scrape"] else "last_scrape"
        paid = at - start
        productive = sum(min(e.t1, at) - e.t0 for e in mine if e.t0 < at)
        out["truth_paid_s"] = round(paid, 3)
        out["truth_productive_s"] = round(productive, 3)
        out["truth_goodput"] = productive / paid if paid > 0 else None
        out["truth_cost_total"] = paid / 3600 * SPOT_PRICE
        out["truth_cost_wasted"] = (paid - productive) / 3600 * SPOT_PRICE
    return out


# ---------------------------------------------------------------------------------------- simulation
def measured_costs(runs: list[dict[str, Any]], fallback: dict[str, list[float]] | None = None,
                   unmeasured: list[str] | None = None) -> sim.ChangeCosts:
    """Pool the runs' per-change cost samples into the simulator's distributions. A cost no clean
    change measured comes from ``fallback`` (another run's), from its sibling (emergency <-> resize
    checkpoint, restore <-> start-up), or stays at the simulator's default; ``unmeasured`` lists those."""
    pooled: dict[str, list[float]] = collections.defaultdict(list)
    for r in runs:
        for k, v in r["measured_costs"].items():
            pooled[k] += v
    for k in [k for k in pooled if k.startswith("overlapped:")]:
        clean = k.split(":", 1)[1]
        if not pooled.get(clean):  # no clean change measured it: the pauses that overlapped another change
            pooled[clean] = list(pooled[k])
    for a, b in (("reformation_s", "join_reformation_s"), ("restore_s", "join_restore_s"), ("restore_s", "startup_s"),
                 ("startup_s", "restore_s"), ("emergency_s", "resize_checkpoint_s"),
                 ("resize_checkpoint_s", "emergency_s")):
        if not pooled.get(a) and pooled.get(b):
            pooled[a] = list(pooled[b])
    out = {}
    optional = {k for k in sim.ChangeCosts.__slots__ if getattr(sim.ChangeCosts(), k) is None}
    for k in sim.ChangeCosts.__slots__:
        vals = pooled.get(k) or (fallback or {}).get(k)
        if vals:
            out[k] = sim.Dist.of(vals)
        elif unmeasured is not None and k not in optional:  # an optional one falls back to the general cost
            unmeasured.append(k)
    return sim.ChangeCosts(**out)


def job_model(run: dict[str, Any], *, torchrun: bool, scale_k: int = 1, max_nodes: int | None = None) -> sim.JobModel:
    """The replayed job: its mean step time per world size, the gap between steps, and whether its worlds
    re-formed in place; torchrun's rounds below ``max_nodes`` (its ``--nnodes`` maximum) wait out torch's
    last call."""
    per_size = run.get("step_s_mean_by_world_size") or run["step_s_by_world_size"]
    steps = tuple((int(w) * scale_k, float(s)) for w, s in per_size.items())
    c10d = {"last_call_s": TORCH_LAST_CALL_S, "max_nodes": max_nodes} if torchrun and max_nodes else {}
    return sim.JobModel(step_times=steps or ((1, 0.2),), samples_per_step=GLOBAL_BATCH, notices=not torchrun,
                        resize_checkpoint=not torchrun, in_place=bool(run.get("in_place")),
                        abandon_in_place=bool(run.get("abandon_in_place", False)),
                        step_overhead_s=float(run.get("step_overhead_s") or 0.0), **c10d)


def sim_drain_lead(a: argparse.Namespace, job: sim.JobModel, costs: sim.ChangeCosts) -> tuple[float, str]:
    """``preemption.drain_lead_s`` as the agents size it on this job (``auto``: the shipped factor and
    floor over the slowest world size's mean step and the longest periodic save, blocked + persist,
    plus the default step-agreement period the replayed agents run with), or the number given."""
    if str(a.drain_lead_s).strip().lower() != "auto":
        return float(a.drain_lead_s), "fixed"
    step = max((st for _, st in job.step_times), default=None)
    ckpt = max(costs.periodic_overhead_s.samples) + max(costs.periodic_persist_s.samples)
    return auto_drain_lead(LeadCosts(step_s=step, checkpoint_s=ckpt, agreement_s=STEP_AGREEMENT_PERIOD_S))


def predict(scaled: sim.Trace, costs: sim.ChangeCosts, job: sim.JobModel, policy: IntervalPolicy, settings: AutoSettings,
            lead_s: float, unannounced: frozenset[int], seeds: int = 5) -> dict[str, Any]:
    rs = [sim.simulate(scaled, costs, job, policy, settings=settings, lead_s=lead_s, unannounced=unannounced, seed=s,
                       prices=sim.Prices(spot_per_hour=SPOT_PRICE, on_demand_per_hour=ON_DEMAND_PRICE))
          for s in range(1, seeds + 1)]
    return _mean(rs)


def _mean(rs: list[sim.SimResult]) -> dict[str, Any]:
    n = len(rs)
    waste = {c: sum(r.waste_node_s[c] for r in rs) / n for c in sim.CAUSES}
    return {"ettr": sum(r.ettr for r in rs) / n, "ettr_min": min(r.ettr for r in rs), "ettr_max": max(r.ettr for r in rs),
            "waste_node_s": waste, "waste_total_node_s": sum(waste.values()),
            "cost_per_sample": sum(r.cost_per_sample for r in rs) / n,
            "on_demand_cost_per_sample": sum(r.on_demand_cost_per_sample for r in rs) / n,
            "changes": sum(len(r.changes) for r in rs) / n, "thrash": sum(r.thrash for r in rs) / n,
            "failures": sum(r.failures_seen for r in rs) / n, "periodic_saves": sum(r.periodic_saves for r in rs) / n,
            "recomputed_steps": sum(r.recomputed_steps for r in rs) / n, "runs": n}


def full_trace(trace: sim.Trace, costs: dict[str, sim.ChangeCosts], runs: dict[str, dict[str, Any]],
               a: argparse.Namespace) -> dict[str, Any]:
    """The whole trace at its real scale with the measured costs: auto, fixed 50 steps, torchrun, a
    sweep of fixed intervals, and the unannounced share x10 / x0.1."""
    k = a.nodes_per_agent
    ref = runs.get("trainguard-auto") or runs.get("trainguard-fixed50")
    job = job_model(ref, torchrun=False, scale_k=k)
    settings = AutoSettings(prior_mtbf_s=a.prior_mtbf_s)  # the shipped defaults of checkpoint.interval_*
    lead = a.real_lead_s
    out: dict[str, Any] = {"lead_s": lead, "nodes_per_agent_for_step_time": k,
                           "assumption": "the job of the replay: a step at n trace nodes takes what it took at n/k agents"}
    if a.sim_step_s:  # a what-if: the measured costs per change and per step, a longer step
        job = dataclasses.replace(job, step_times=tuple((w, a.sim_step_s) for w, _ in job.step_times))
        out.update(sim_step_s=a.sim_step_s, assumption=f"what-if: every step takes {a.sim_step_s:g} s (the measured "
                   "costs per change and the measured time between steps unchanged)")
    tg_costs = costs["trainguard"]
    # preemption.train_through_notice (the default): a notice further than the drain lead from its reclaim
    # takes a checkpoint at once and the world trains on until the lead before it.
    lead_s, basis = sim_drain_lead(a, job, tg_costs)
    through = dataclasses.replace(job, drain_lead_s=lead_s)
    out.update(drain_lead_s=lead_s, drain_lead_basis=basis)
    shares = [("x1", a.sim_unannounced), ("x10", min(1.0, a.sim_unannounced * 10)), ("x0.1", a.sim_unannounced / 10)]
    for share_name, share in shares[:1] if a.no_sweep else shares:
        unann = [sim.pick_unannounced(trace, share, seed=s) for s in range(1, a.sim_seeds + 1)]

        def run(policy: IntervalPolicy, c: sim.ChangeCosts = tg_costs, j: sim.JobModel = through) -> dict[str, Any]:
            rs = [sim.simulate(trace, c, j, policy, settings=settings, lead_s=lead, unannounced=u, seed=s,
                               prices=sim.Prices(spot_per_hour=SPOT_PRICE, on_demand_per_hour=ON_DEMAND_PRICE))
                  for s, u in enumerate(unann, 1)]
            return _mean(rs)

        block: dict[str, Any] = {"unannounced_share": share}
        block["trainguard-auto"] = run(IntervalPolicy(IntervalMode.AUTO))
        block["trainguard-fixed50"] = run(IntervalPolicy(IntervalMode.FIXED, steps=FIXED_STEPS))
        # preemption.train_through_notice: false (the default until 2026-11-26): every notice drains at once.
        block["trainguard-auto-drain-at-notice"] = run(IntervalPolicy(IntervalMode.AUTO), j=job)
        sweep = [(t, run(IntervalPolicy(IntervalMode.FIXED, seconds=t))["waste_total_node_s"])
                 for t in ([] if a.no_sweep else [2 * 1.5 ** i for i in range(14)])]  # 2 s .. 6.5 min
        if not sweep:
            out[share_name] = block
            continue
        best_t, best_w = min(sweep, key=lambda x: x[1])
        block["sweep"] = [{"interval_s": round(t, 2), "waste_node_s": round(w, 1)} for t, w in sweep]
        block["best_fixed"] = {"interval_s": round(best_t, 2), "waste_node_s": best_w}
        block["auto_vs_best_waste"] = block["trainguard-auto"]["waste_total_node_s"] / best_w
        block["auto_vs_fixed50_waste"] = (block["trainguard-auto"]["waste_total_node_s"]
                                          / block["trainguard-fixed50"]["waste_total_node_s"])
        if "torchrun" in costs:  # the same job (trainguard's step times), torchrun's behaviour and costs
            bjob = sim.JobModel(step_times=job.step_times, samples_per_step=GLOBAL_BATCH, notices=False,
                                resize_checkpoint=False, last_call_s=TORCH_LAST_CALL_S,
                                max_nodes=max(n for _, n in trace.sizes()))  # torchrun --nnodes 1:<the trace's most>
            block["baseline"] = run(IntervalPolicy(IntervalMode.FIXED, steps=FIXED_STEPS), costs["torchrun"], bjob)
        out[share_name] = block
    return out


# ---------------------------------------------------------------------------------------- report
def plot(runs: dict[str, dict[str, Any]], path: str, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install trainguard[bench])"
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for name, r in runs.items():
        tl = r["world_timeline"]
        axes[0].step(tl["t"], tl["world"], where="post", label=name, linewidth=1)
        axes[1].plot(tl["t"], tl["useful_steps"], label=name, linewidth=1)
    axes[0].set_ylabel("world size (ranks)")
    axes[1].set_ylabel("cumulative useful steps")
    axes[1].set_xlabel("replay time (s)")
    axes[0].set_title(title)
    axes[0].legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def fmt(v: Any, spec: str = ".3f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=os.path.join(REPO, "..", "shared", "traces", "parcae-aws-p3.csv"))
    ap.add_argument("--quick", action="store_true", help="a 2-hour window, two agents at most: a few minutes")
    ap.add_argument("--start-h", type=float, default=0.0, help="replay the trace from this hour")
    ap.add_argument("--hours", type=float, default=None, help="replay this many hours (default: all)")
    ap.add_argument("--nodes-per-agent", type=int, default=11)
    ap.add_argument("--rounding", choices=["up", "nearest"], default="up", help="agents = ceil or round(nodes / k)")
    ap.add_argument("--max-agents", type=int, default=3)
    ap.add_argument("--speed", type=float, default=130.0, help="time compression of the replay")
    ap.add_argument("--lead-s", type=float, default=5.0, help="replay seconds between a notice and the node's end")
    ap.add_argument("--real-lead-s", type=float, default=120.0, help="notice lead for the full-trace simulation")
    ap.add_argument("--unannounced", type=float, default=0.25,
                    help="share of removals with no notice in the replay (more than the simulation's, so that the "
                         "replay measures failure detection a few times)")
    ap.add_argument("--drain-lead-s", default="auto",
                    help="full trace: preemption.drain_lead_s of the simulated agents (train_through_notice, the "
                         "default): auto (sized as the agents do from the measured step and save times) or seconds")
    ap.add_argument("--sim-unannounced", type=float, default=0.1, help="share of removals with no notice, full trace")
    ap.add_argument("--unannounced-indices", default=None,
                    help="comma-separated indices of the replay's removals that come with no notice (instead of the share)")
    ap.add_argument("--baseline-costs", default=None, metavar="JSON",
                    help="without a baseline run here: take torchrun's measured costs from this earlier run's JSON")
    ap.add_argument("--sim-step-s", type=float, default=None,
                    help="full trace: a what-if with every step this long (the measured per-change costs and time "
                         "between steps unchanged), e.g. 1.0 for a GPU-sized step; default: the replay's step times")
    ap.add_argument("--no-sweep", action="store_true",
                    help="full-trace simulation: skip the fixed-interval sweep and the x10 / x0.1 variants (CI)")
    ap.add_argument("--d-model", type=int, default=None, help="the bundled model's width (default: the example's, 64)")
    ap.add_argument("--layers", type=int, default=None, help="the bundled model's depth (default: the example's, 2)")
    ap.add_argument("--store-bytes-per-s", type=float, default=None,
                    help="bandwidth-limit the checkpoint store: each node's process reads and writes it at most this "
                         "many bytes per second (bench/throttled_store)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--step-sleep", type=float, default=0.05)
    ap.add_argument("--auto-min-s", type=float, default=1.0, help="checkpoint.interval_min_s of the auto run")
    ap.add_argument("--prior-mtbf-s", type=float, default=3600.0, help="real seconds; the replay divides by --speed")
    ap.add_argument("--runs", default="trainguard-auto,trainguard-fixed50,baseline",
                    help="runs in order: trainguard-auto, trainguard-fixed50, baseline (torchrun), trainguard-auto-drain "
                         "(train_through_notice off: every notice drains at once), trainguard-auto-notier0 (in-memory "
                         "snapshots off, the default before 2026-11-27); a suffix #k repeats "
                         "one (e.g. baseline,baseline#2): the report adds the mean of the repeats against the mean prediction")
    ap.add_argument("--sim-seeds", type=int, default=10)
    ap.add_argument("--validate", default=None, metavar="JSON,...",
                    help="no replay: earlier replays' measured ETTR against the prediction from physics-derived save "
                         "costs (the fixed parts from --physics-base), same schedule options as those runs")
    ap.add_argument("--physics-base", default=None, metavar="JSON", help="--validate: the bundled model's replay")
    ap.add_argument("--physics-host-from", default=None, metavar="JSON",
                    help="--validate: an unthrottled replay of a large state, whose persist measures the host's save "
                         "pipeline (serialise, CRC32, write) on this machine's busy cores")
    ap.add_argument("--physics-costs-from", default=None, metavar="JSON",
                    help="--validate: the costs that do not depend on the store from this replay (e.g. the "
                         "unthrottled replay of the same model) instead of each validated run's own")
    ap.add_argument("--profiles", action="store_true",
                    help="no replay: the whole trace for this machine's measured costs and the GPU profiles of "
                         "bench/spotcost.py, at 1/10/100 %% unannounced x AWS 120 s / GCP 30 s notices")
    ap.add_argument("--profile-costs", default=os.path.join(REPO, "docs", "results", "spot", "tier0-ab-2026-11-27.json"),
                    help="--profiles: the replay JSON whose measured costs are this machine's profile")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs, samples, replay.json)")
    ap.add_argument("--reanalyse", default=None, metavar="WORK_FOLDER",
                    help="analyse and simulate the runs kept by an earlier --keep run (same schedule options) "
                         "instead of replaying: no agents are started")
    ap.add_argument("--costs-from", default=None, metavar="JSON",
                    help="simulate the whole trace again from the costs an earlier run measured (its --json), "
                         "with this run's simulation options (--real-lead-s, --drain-lead-s, --sim-unannounced, "
                         "--sim-seeds, --no-sweep): no replay, no agents")
    a = ap.parse_args(argv)
    if a.profiles:
        return profiles(a)
    if a.validate:
        return validate(a)
    if a.costs_from:
        return resimulate(a)
    if a.quick:
        a.hours = a.hours or 2.0

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    trace = sim.load_trace(a.trace)
    win = sim.window(trace, a.start_h * 3600, (a.hours * 3600) if a.hours else trace.duration_s - a.start_h * 3600)
    scaled = sim.scale(win, nodes_per_agent=a.nodes_per_agent, max_agents=a.max_agents, speed=a.speed,
                       rounding=a.rounding)
    unannounced = (frozenset(int(i) for i in a.unannounced_indices.split(",") if i.strip())
                   if a.unannounced_indices is not None else sim.pick_unannounced(scaled, a.unannounced, seed=a.seed))
    print(f"trace {trace.name}: {trace.duration_s / 3600:.2f} h, {len(trace.instants())} change instants, "
          f"{len(trace.removals())} removals; replaying {win.name}", flush=True)
    print(f"scale: 1 agent per {a.nodes_per_agent} trace nodes ({a.rounding}, at most {a.max_agents}), "
          f"time compressed x{a.speed:g}: "
          f"{scaled.duration_s:.0f} s per run, {len(scaled.instants())} agent-count changes, "
          f"{len(scaled.removals())} removals ({len(unannounced)} unannounced), notice lead {a.lead_s:g} s", flush=True)
    work = a.reanalyse or tempfile.mkdtemp(prefix="tg-bench-spot-")
    res: dict[str, Any] = {"trace": trace.name, "window": win.name, "nodes_per_agent": a.nodes_per_agent,
                           "max_agents": a.max_agents, "speed": a.speed, "lead_s": a.lead_s,
                           "store_bytes_per_s": a.store_bytes_per_s, "model": {"d_model": a.d_model, "layers": a.layers},
                           "unannounced_share": a.unannounced, "replay_s": scaled.duration_s,
                           "scaled_changes": len(scaled.instants()), "cpus": os.cpu_count(), "prices": {
                               "spot_per_hour": SPOT_PRICE, "on_demand_per_hour": ON_DEMAND_PRICE}}
    runs: dict[str, dict[str, Any]] = {}
    raws: dict[str, ReplayRaw] = {}
    t_start = time.time()
    try:
        for name in [r for r in a.runs.split(",") if r]:
            mode = "torchrun" if run_kind(name) == "baseline" else run_kind(name)
            acts = schedule(scaled, unannounced, a.lead_s, notices=mode != "torchrun")
            print(f"\n== {name}: {len(acts)} actions over {scaled.duration_s:.0f} s", flush=True)
            if a.reanalyse:  # the logs of an earlier --keep run of the same schedule
                raw = load_raw(os.path.join(a.reanalyse, name))
                if [(x.t, x.kind, x.agent) for x in raw.actions] != [(x.t, x.kind, x.agent) for x in acts]:
                    raise SystemExit(f"--reanalyse {a.reanalyse}: {name} ran another schedule; pass the same "
                                     "--trace/--start-h/--hours/--speed/--seed options as that run")
            else:
                raw = replay(name, mode, acts, scaled.duration_s, a, work, a.max_agents)
            raws[name] = raw
            runs[name] = analyse(raw, scaled, max_nodes=a.max_agents)
            r = runs[name]
            print(f"   ETTR {r['ettr']:.3f}, final step {r['final_step']}, lost steps {r['lost_steps']}, "
                  f"skipped/repeated samples {r['skipped_samples']}/{r['repeated_samples']}", flush=True)
    finally:
        # A re-analysis started nothing (and its own command line, and a wrapper's such as timeout, name the folder).
        left = [] if a.reanalyse else strays(work)
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        res["leftover_processes"] = len(left)
        if not a.reanalyse:  # SIGKILLed agents leave their tier-0 folders
            for name in os.listdir(work):
                shutil.rmtree(memory_root(os.path.join(work, name)), ignore_errors=True)
        if not a.keep and not a.reanalyse:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work folder kept: {work}")
    res["replay_wall_s"] = round(time.time() - t_start, 1)

    tg_runs = [r for n, r in runs.items() if n.startswith("trainguard")]
    costs: dict[str, sim.ChangeCosts] = {}
    unmeasured: dict[str, list[str]] = {"trainguard": [], "torchrun": []}
    if tg_runs:
        costs["trainguard"] = measured_costs(tg_runs, unmeasured=unmeasured["trainguard"])
    baselines = [r for n, r in runs.items() if run_kind(n) == "baseline"]
    if baselines:
        pooled_tg: dict[str, list[float]] = collections.defaultdict(list)
        for r in tg_runs:
            for k, v in r["measured_costs"].items():
                pooled_tg[k] += v
        # Its torch.save runs inside the step (counted as step time, as the replay measures it): no
        # separate periodic cost.
        # Its first start is measured from the agents' start (startup_s); a joiner's warm-up is an
        # agent's start (trainguard's, the same Python and torch imports).
        costs["torchrun"] = measured_costs(baselines, fallback={
            "warmup_s": pooled_tg.get("agent_start_s", []), "agent_start_s": [0.0], "start_reformation_s": [0.0],
            "periodic_overhead_s": [0.0], "periodic_persist_s": [0.0],
            "emergency_s": [0.0], "resize_checkpoint_s": [0.0], "detect_notice_s": [0.0]}, unmeasured=unmeasured["torchrun"])
    if "torchrun" not in costs and a.baseline_costs:
        with open(a.baseline_costs) as fh:
            costs["torchrun"] = sim.ChangeCosts.from_dict(json.load(fh)["measured_costs"]["torchrun"])
        res["baseline_costs_from"] = a.baseline_costs
    res["measured_costs"] = {k: v.as_dict() for k, v in costs.items()}
    res["unmeasured_costs"] = unmeasured
    for k, v in unmeasured.items():
        if v:
            print(f"{k}: not measured by any clean change, simulator defaults used: {v}", flush=True)
    # The simulator on the replayed schedule: its prediction against the measurement. Each run is
    # predicted from the costs its own changes measured (runs of one schedule differ by the load beside
    # them on a shared machine); a cost it did not measure comes from the pooled runs.
    settings = AutoSettings(min_s=a.auto_min_s, max_s=3600 / a.speed, prior_mtbf_s=a.prior_mtbf_s / a.speed)
    for name, r in runs.items():
        torchrun = run_kind(name) == "baseline"
        policy = (IntervalPolicy(IntervalMode.AUTO) if run_kind(name).startswith("trainguard-auto")
                  else IntervalPolicy(IntervalMode.FIXED, steps=FIXED_STEPS))
        pooled = costs["torchrun" if torchrun else "trainguard"]
        c = measured_costs([r], fallback=pooled.as_dict())
        job = job_model(r, torchrun=torchrun, max_nodes=a.max_agents)
        if not torchrun and run_kind(name) != "trainguard-auto-drain":  # the agents' default: train through a
            # notice until the drain lead (runs before 2026-11-26 drained at once; their 5 s notices were
            # shorter than any lead, the same either way)
            job = dataclasses.replace(job, drain_lead_s=sim_drain_lead(a, job, c)[0])
        p = predict(scaled, c, job, policy, settings, a.lead_s, unannounced, a.sim_seeds)
        r["predicted_from"] = "own costs"
        r["predicted"] = p
        r["prediction_error_points"] = round(100 * (p["ettr"] - r["ettr"]), 2)
    res["repeats"] = repeats(runs)
    if tg_runs:
        res["full_trace"] = full_trace(trace, costs, runs, a)
    res["runs"] = {n: {k: v for k, v in r.items() if k != "world_timeline"} for n, r in runs.items()}
    for n, r in runs.items():
        res["runs"][n]["world_timeline_points"] = len(r["world_timeline"]["t"])
    # The headline keys (trainguard auto; baseline figures beside them).
    head = runs.get("trainguard-auto") or next(iter(runs.values()), None)
    if head is not None:
        res["ettr"] = head["ettr"]
        res["cost_per_sample"] = head["cost_per_sample"]
        res["on_demand_cost_per_sample"] = head["on_demand_cost_per_sample"]
        res["waste_by_cause"] = head["waste_by_cause"]
        res["waste_by_cause_predicted"] = head["predicted"]["waste_node_s"]
        res["changes"] = head["changes"]
        res["lost_steps"] = head["lost_steps"]
        res["skipped_samples"] = head["skipped_samples"]
        res["repeated_samples"] = head["repeated_samples"]
    if "baseline" in runs:
        b = runs["baseline"]
        res.update(baseline_ettr=b["ettr"], baseline_cost_per_sample=b["cost_per_sample"],
                   baseline_lost_steps=b["lost_steps"], baseline_skipped_samples=b["skipped_samples"],
                   baseline_repeated_samples=b["repeated_samples"])
    report(res, runs)
    if a.plot and runs:
        err = plot(runs, a.plot, f"{win.name}: 1 agent / {a.nodes_per_agent} nodes, x{a.speed:g}")
        res["plot"] = a.plot if err is None else None
        if err:
            print(f"no plot: {err}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1, sort_keys=True, default=float)
    return 0 if runs else 1


SHARES = (0.01, 0.1, 1.0)
NEXT_MECHANISM = {
    "warmup": "joiners' warm-up (images and weights prefetched on the AMI, a warm standby pool)",
    "notice_lead": "the drain-lead floor (preemption.drain_lead_s: drain closer to the reclaim)",
    "between_steps": "the per-step agreement (a longer stride or an agreement fused into the step's all-reduce)",
    "recompute": "the work lost to rollbacks (tier 1 for every loss, a shorter interval)",
    "restore": "restore after each re-formation (its communicator set-up, comm_init_s: keep or shrink communicators instead of a new init; then the state hand-over)",
    "detection": "failure detection (evict on evidence instead of the keep-alive)",
    "reformation": "re-formation (the rendezvous round and communicator set-up)",
    "checkpoint": "the emergency checkpoint (to tier 1 / peers before storage)",
    "periodic_checkpoint": "periodic saves (staging cost, interval)",
    "idle": "idle nodes (max nodes, or a second job)",
}


def mean_world(trace: sim.Trace) -> int:
    """The trace's time-weighted mean node count (the world size the derived costs are taken at)."""
    sizes = trace.sizes()
    total = sum(n * (t1 - t0) for (t0, n), (t1, _) in zip(sizes, sizes[1:] + [(trace.duration_s, 0)]))
    return max(1, round(total / trace.duration_s))


def profiles(a: argparse.Namespace) -> int:
    """``--profiles``: the whole trace for this machine's measured costs (``--profile-costs``, a replay's
    JSON) and the GPU profiles of :mod:`bench.spotcost`, x ``SHARES`` unannounced x AWS/GCP notices."""
    trace = sim.load_trace(a.trace)
    n = mean_world(trace)
    with open(a.profile_costs) as fh:
        base = json.load(fh)
    ref = base["runs"].get("trainguard-auto") or next(iter(base["runs"].values()))
    here_job = job_model(ref, torchrun=False, scale_k=base["nodes_per_agent"])
    here = ("this-machine", sim.ChangeCosts.from_dict(base["measured_costs"]["trainguard"]), here_job,
            sim.Prices(spot_per_hour=SPOT_PRICE, on_demand_per_hour=ON_DEMAND_PRICE),
            {"costs": f"bench/spot_trace.py: measured by the replay in {os.path.basename(a.profile_costs)}",
             "failures": "kill (as replayed: sockets reset)"})
    setups = [here]
    for phys in (spotcost.GPU_7B_FSDP, spotcost.without_tier1(spotcost.GPU_7B_FSDP), spotcost.GPU_70B):
        setups.append((phys.name, phys.costs(n), phys.job(), sim.Prices(spot_per_hour=phys.spot_per_hour.value,
                       on_demand_per_hour=phys.on_demand_per_hour.value),
                       {"params": phys.params(), "failures": "frozen (a reclaimed VM: no reset)", "costs_at_nodes": n,
                        "tier1": phys.tier1.value, "parity_group": phys.parity_group, "state": phys.state.value,
                        "derived_costs": phys.costs(n).as_dict()}))
    settings = AutoSettings(prior_mtbf_s=a.prior_mtbf_s)
    out: dict[str, Any] = {"trace": trace.name, "mean_nodes": n, "seeds": a.sim_seeds, "policy": "auto",
                           "notice_s": {c.value: s for c, s in spotcost.NOTICE_S.items()}, "profiles": {}, "rows": []}
    print(f"{trace.name}: costs derived at {n} nodes (time-weighted mean); auto interval; mean of {a.sim_seeds} seeds")
    print(f"{'profile':<18} {'cloud':<5} {'unann':>5} {'ETTR':>7} {'waste node-h by cause (largest first)':<60} {'$/1k samples':>12} {'on-demand':>10}")
    for name, costs, job, prices, info in setups:
        lead, basis = auto_drain_lead(LeadCosts(step_s=job.step_time_s(n), checkpoint_s=max(costs.periodic_overhead_s.samples)
                                                + max(costs.periodic_persist_s.samples), agreement_s=STEP_AGREEMENT_PERIOD_S))
        job = dataclasses.replace(job, drain_lead_s=lead)
        out["profiles"][name] = {**info, "drain_lead_s": lead, "drain_lead_basis": basis}
        for cloud in (spotcost.Cloud.AWS, spotcost.Cloud.GCP):
            for share in SHARES:
                rs = [sim.simulate(trace, costs, job, IntervalPolicy(IntervalMode.AUTO), settings=settings,
                                   lead_s=spotcost.NOTICE_S[cloud], unannounced=sim.pick_unannounced(trace, share, seed=s),
                                   seed=s, prices=prices) for s in range(1, a.sim_seeds + 1)]
                m = _mean(rs)
                waste = sorted(((c, v / 3600) for c, v in m["waste_node_s"].items() if v > 0), key=lambda x: -x[1])
                row = {"profile": name, "cloud": cloud.value, "notice_s": spotcost.NOTICE_S[cloud], "unannounced": share,
                       "ettr": m["ettr"], "ettr_min": m["ettr_min"], "ettr_max": m["ettr_max"],
                       "waste_node_h": {c: round(v, 3) for c, v in waste},
                       "cost_per_1k_samples": m["cost_per_sample"] * 1000,
                       "on_demand_cost_per_1k_samples": m["on_demand_cost_per_sample"] * 1000,
                       "next_mechanism": NEXT_MECHANISM[waste[0][0]] if m["ettr"] < 0.99 and waste else None}
                out["rows"].append(row)
                top = ", ".join(f"{c} {v:.2f}" for c, v in waste[:4])
                print(f"{name:<18} {cloud.value:<5} {share:>5.2f} {m['ettr']:7.4f} {top:<60} "
                      f"{row['cost_per_1k_samples']:12.4f} {row['on_demand_cost_per_1k_samples']:10.4f}", flush=True)
    for name, p in out["profiles"].items():
        for k, v in p.get("params", {}).items():
            print(f"  {name} {k} = {v['value']:g}  [{v['source']}]")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1, sort_keys=True, default=float)
    return 0


def copy_and_store_bw(folder: str, nbytes: int = 64 << 20) -> tuple[float, float]:
    """This machine's host copy bandwidth (a tensor clone: what staging does on CPU) and the local store's
    write bandwidth as a checkpoint writes (CRC32 of every byte, fsync), in bytes/s."""
    import zlib

    import torch

    t = torch.empty(nbytes, dtype=torch.uint8)
    t0 = time.perf_counter()
    t.clone()
    copy = nbytes / (time.perf_counter() - t0)
    data = bytes(nbytes)
    path = os.path.join(folder, ".bw-probe")
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        for i in range(0, nbytes, 4 << 20):
            zlib.crc32(data[i:i + (4 << 20)])
            fh.write(data[i:i + (4 << 20)])
        fh.flush()
        os.fsync(fh.fileno())
    store = nbytes / (time.perf_counter() - t0)
    os.remove(path)
    return copy, store


@dataclass(frozen=True, slots=True)
class HostPipeline:
    """A node's checkpoint pipeline on this machine's cores (DCP serialisation, CRC32, the local write or
    read calls: one checkpoint thread per rank), in bytes/s, in series with a store's transfer (the
    thread waits for the store, then works: they do not overlap). ``background``: a periodic save's
    persist, while the training runs on the same cores; ``foreground``: the world stopped (an emergency
    or resize checkpoint, a restore from storage); ``stage``: a save's blocking copy of the state."""

    background: float
    foreground: float
    stage: float
    source: str


def _mean_nodes(run: dict[str, Any]) -> float:
    sizes = run["training_s_by_world_size"]
    return sum(int(w) * t for w, t in sizes.items()) / max(1e-9, sum(sizes.values()))


def host_pipeline(run_json: dict[str, Any], base: dict[str, Any], name: str) -> HostPipeline:
    """Measured by a replay of a large state on the local store (no throttle): bytes per node over its
    median periodic persist (background), over its median emergency checkpoint less its staging
    (foreground), each less the bundled replay's fixed part of a commit, and over its median blocking
    (stage) less the bundled replay's."""
    if run_json.get("store_bytes_per_s"):
        raise ValueError("the host pipeline is measured on an unthrottled replay (no --store-bytes-per-s)")
    r = run_json["runs"]["trainguard-auto"]
    m = run_json["measured_costs"]["trainguard"]
    share = float(r["checkpoint_bytes"]) / max(1.0, _mean_nodes(r))
    bc = base["measured_costs"]["trainguard"]
    fixed = statistics.median(bc["periodic_persist_s"])
    persist = statistics.median(m["periodic_persist_s"]) - fixed
    emergency = statistics.median(m.get("emergency_s") or [0.0]) - statistics.median(m["periodic_overhead_s"]) - fixed
    stage = statistics.median(m["periodic_overhead_s"]) - statistics.median(bc["periodic_overhead_s"])
    if persist <= 0 or emergency <= 0 or stage <= 0:
        raise ValueError(f"{name}: its persist / emergency checkpoint / blocking is not above the bundled model's")
    return HostPipeline(share / persist, share / emergency, share / stage,
                        f"bench/spot_trace.py: {name}, {share / 1e6:.1f} MB per node, median persist, emergency checkpoint "
                        f"and blocking")


def physics_costs(measured: sim.ChangeCosts, base: dict[str, Any], state_bytes: float, nodes: float,
                  copy_bw: float, store_bw: float, host: HostPipeline | None = None) -> sim.ChangeCosts:
    """``measured`` (the replay's costs, or a reference replay's) with the state-dependent ones derived
    as :mod:`bench.spotcost` does (a node's share ``state / nodes``; the fixed parts measured on
    ``base``, the bundled model's replay): periodic save blocking and persist, emergency and resize
    checkpoints, and a restore from storage (after an abandoned emergency checkpoint, or from zero
    nodes: the replicated state whole per node, after the worker's own start, ``startup_s``, which reads
    no checkpoint). The bytes move at ``store_bw`` and, with ``host``, through the host's pipeline too."""
    bc = base["measured_costs"]["trainguard"]
    share = state_bytes / max(1.0, nodes)
    fixed = statistics.median(bc["periodic_persist_s"])
    back = 1.0 / store_bw + (1.0 / host.background if host else 0.0)
    fore = 1.0 / store_bw + (1.0 / host.foreground if host else 0.0)
    stage = statistics.median(bc["periodic_overhead_s"]) + share / (host.stage if host else copy_bw)
    persist = fixed + share * back
    save = stage + fixed + share * fore
    from_storage = statistics.median(measured.startup_s.samples) + state_bytes * fore
    # The persist's own CPU work (the pipeline's time with the world stopped) runs on the training's cores.
    interference = sim.Dist.of(share / host.foreground) if host else measured.periodic_interference_s
    return dataclasses.replace(measured, periodic_overhead_s=sim.Dist.of(stage), periodic_persist_s=sim.Dist.of(persist),
                               periodic_interference_s=interference,
                               emergency_s=sim.Dist.of(save), resize_checkpoint_s=sim.Dist.of(save),
                               storage_restore_s=sim.Dist.of(from_storage), cold_restore_s=sim.Dist.of(from_storage))


def validate(a: argparse.Namespace) -> int:
    """``--validate RUN_JSON,...``: each replay's measured ETTR against the simulator's prediction from
    physics-derived save and storage-restore costs (:func:`physics_costs`; the fixed parts from
    ``--physics-base``), same schedule options as those runs. ``--physics-host-from``: the host pipeline
    an unthrottled large-state replay measured (:func:`host_pipeline`, its staging copy too; without it
    the bytes move at the local store's raw bandwidth and staging at the host copy bandwidth probed now).
    ``--physics-costs-from``: the costs that do not depend on the store (detection, re-formation,
    in-place restores, warm-up, start-up) from that replay instead of each run's own (a throttled run
    predicted from the unthrottled one)."""
    with open(a.physics_base) as fh:
        base = json.load(fh)
    trace = sim.load_trace(a.trace)
    win = sim.window(trace, a.start_h * 3600, (a.hours or 2.0) * 3600)
    scaled = sim.scale(win, nodes_per_agent=a.nodes_per_agent, max_agents=a.max_agents, speed=a.speed, rounding=a.rounding)
    unannounced = sim.pick_unannounced(scaled, a.unannounced, seed=a.seed)
    copy_bw, local_bw = copy_and_store_bw(tempfile.gettempdir())
    settings = AutoSettings(min_s=a.auto_min_s, max_s=3600 / a.speed, prior_mtbf_s=a.prior_mtbf_s / a.speed)
    out: dict[str, Any] = {"physics_base": os.path.basename(a.physics_base), "copy_bw": copy_bw, "local_store_bw": local_bw,
                           "runs": []}
    host = None
    if a.physics_host_from:
        with open(a.physics_host_from) as fh:
            host = host_pipeline(json.load(fh), base, os.path.basename(a.physics_host_from))
        out["host_pipeline"] = dataclasses.asdict(host)
        print(f"host pipeline {host.background / 1e6:.1f} MB/s behind training, {host.foreground / 1e6:.1f} MB/s with "
              f"the world stopped, staging {host.stage / 1e6:.0f} MB/s [{host.source}]")
    reference = None
    if a.physics_costs_from:
        with open(a.physics_costs_from) as fh:
            reference = sim.ChangeCosts.from_dict(json.load(fh)["measured_costs"]["trainguard"])
        out["costs_from"] = os.path.basename(a.physics_costs_from)
    print(f"host copy {copy_bw / 1e9:.2f} GB/s, local store {local_bw / 1e6:.0f} MB/s (measured now)")
    for path in a.validate.split(","):
        with open(path) as fh:
            res = json.load(fh)
        r = res["runs"]["trainguard-auto"]
        throttle = float(res.get("store_bytes_per_s") or 0.0)
        # With the host pipeline measured, the local store's own write is part of it; a throttle adds its wait.
        bw = throttle or (math.inf if host else local_bw)
        measured = sim.ChangeCosts.from_dict(res["measured_costs"]["trainguard"])
        job = dataclasses.replace(job_model(r, torchrun=False, max_nodes=a.max_agents),
                                  drain_lead_s=sim_drain_lead(a, job_model(r, torchrun=False), measured)[0])
        c = physics_costs(reference or measured, base, float(r["checkpoint_bytes"]), _mean_nodes(r), copy_bw, bw, host)
        p = predict(scaled, c, job, IntervalPolicy(IntervalMode.AUTO), settings, a.lead_s, unannounced, a.sim_seeds)
        fitted = [os.path.basename(f) for f in (a.physics_host_from, a.physics_costs_from) if f and os.path.samefile(f, path)]
        row = {"run": os.path.basename(path), "checkpoint_bytes": r["checkpoint_bytes"],
               "store_bytes_per_s": throttle or (None if host else local_bw), "throttled": bool(throttle),
               "calibrated_on_this_run": bool(fitted),
               "ettr": r["ettr"], "predicted_measured_costs": r["predicted"]["ettr"], "predicted_physics": p["ettr"],
               "predicted_physics_min_max": [p["ettr_min"], p["ettr_max"]],
               "error_points_physics": round(100 * (p["ettr"] - r["ettr"]), 2),
               "error_points_measured_costs": r["prediction_error_points"],
               "persist_s_measured": statistics.median(res["measured_costs"]["trainguard"]["periodic_persist_s"]),
               "persist_s_physics": c.periodic_persist_s.mean, "emergency_s_physics": c.emergency_s.mean,
               "storage_restore_s_physics": c.storage_restore_s.mean,
               "waste_node_s_physics": p["waste_node_s"], "waste_node_s_measured": r.get("waste_by_cause")}
        out["runs"].append(row)
        store = f"{throttle / 1e6:g} MB/s throttled" if throttle else "local store"
        print(f"{row['run']}: {row['checkpoint_bytes'] / 1e6:.1f} MB, {store}; ETTR {r['ettr']:.4f}, "
              f"predicted {p['ettr']:.4f} from physics ({row['error_points_physics']:+.2f} points; seeds "
              f"{p['ettr_min']:.4f}-{p['ettr_max']:.4f}), {r['predicted']['ettr']:.4f} from measured costs "
              f"({r['prediction_error_points']:+.2f}); persist measured {row['persist_s_measured']:.3f} s, physics "
              f"{row['persist_s_physics']:.3f} s; emergency physics {row['emergency_s_physics']:.3f} s; storage restore "
              f"physics {row['storage_restore_s_physics']:.2f} s{' (calibrated on this run)' if fitted else ''}", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1, sort_keys=True, default=float)
    return 0


def run_kind(name: str) -> str:
    """``baseline``, ``trainguard-auto``, ``trainguard-auto-drain``, ``trainguard-auto-notier0`` or ``trainguard-fixed50``: a run's name less its repeat suffix
    (``--runs baseline,baseline#2,baseline#3`` replays the same schedule three times)."""
    return name.split("#", 1)[0]


def repeats(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind of run replayed more than once: the mean measured ETTR against the mean of the
    predictions (each run's from its own costs). One replay fixes the phase of every failure in the save
    cycle and every removal's place in a restart; the mean over repeats is what the simulator's seeds
    average."""
    out: dict[str, dict[str, Any]] = {}
    for kind in sorted({run_kind(n) for n in runs}):
        rs = [r for n, r in runs.items() if run_kind(n) == kind]
        if len(rs) < 2:
            continue
        measured = statistics.fmean(r["ettr"] for r in rs)
        predicted = statistics.fmean(r["predicted"]["ettr"] for r in rs)
        out[kind] = {"runs": len(rs), "ettr": [round(r["ettr"], 4) for r in rs], "ettr_mean": round(measured, 4),
                     "predicted_mean": round(predicted, 4),
                     "prediction_error_points": round(100 * (predicted - measured), 2)}
    return out


def resimulate(a: argparse.Namespace) -> int:
    """``--costs-from``: the full-trace simulation of an earlier run's measured costs and step times, the
    replay's own figures carried over unchanged (they were measured then, not now)."""
    with open(a.costs_from) as fh:
        res = json.load(fh)
    a.nodes_per_agent = res["nodes_per_agent"]  # the step times were measured at that scale
    trace = sim.load_trace(a.trace)
    costs = {k: sim.ChangeCosts.from_dict(v) for k, v in res["measured_costs"].items()}
    runs = res["runs"]
    res["full_trace"] = full_trace(trace, costs, runs, a)
    res["full_trace_costs_from"] = a.costs_from
    print(f"costs and replay figures from {a.costs_from} (replayed {res['window']}); the full trace simulated again")
    report(res, runs)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1, sort_keys=True, default=float)
    return 0


def report(res: dict[str, Any], runs: dict[str, dict[str, Any]]) -> None:
    print("\nreplay (measured; predicted by the simulator from the measured costs)")
    print(f"{'run':<20} {'ETTR':>6} {'pred':>6} {'err pts':>7} {'$/1k samples':>12} {'lost steps':>10} {'skip/rep':>9} {'saves':>5}")
    for n, r in runs.items():
        cps = r["cost_per_sample"]
        print(f"{n:<20} {r['ettr']:6.3f} {r['predicted']['ettr']:6.3f} {r['prediction_error_points']:7.2f} "
              f"{fmt(cps * 1000 if cps else None, '.4f'):>12} {r['lost_steps']:>10} "
              f"{r['skipped_samples']}/{r['repeated_samples']:<7} {r.get('periodic_saves', '-'):>5}")
    for n, r in runs.items():
        print(f"  {n}: training s by world size {r['training_s_by_world_size']}, step s {r['step_s_by_world_size']}")
        agents = {k: (fmt(v.get('metric_goodput')), fmt(v.get('truth_goodput'))) for k, v in r.get("agents", {}).items()
                  if v.get("truth_goodput") is not None}
        if agents:
            print(f"  {n}: goodput metric vs truth per agent {agents}")
    for kind, m in res.get("repeats", {}).items():
        print(f"  {kind}: {m['runs']} replays of the schedule, ETTR {m['ettr']}, mean {m['ettr_mean']:.3f}, "
              f"predicted mean {m['predicted_mean']:.3f} ({m['prediction_error_points']:+.2f} points)")
    ft = res.get("full_trace")
    if not ft:
        return
    print(f"\nfull trace at real scale (simulated, notice lead {ft['lead_s']:g} s, trainguard trains through a "
          f"notice until {ft.get('drain_lead_s', 0):g} s before its end ({ft.get('drain_lead_basis', '')}), mean of seeds)")
    print(f"{'unannounced':<12} {'run':<32} {'ETTR':>6} {'waste node-h':>12} {'$/1k samples':>12} {'on-demand':>10}")
    for key in ("x1", "x10", "x0.1"):
        if key not in ft:
            continue
        b = ft[key]
        for n in ("trainguard-auto", "trainguard-fixed50", "trainguard-auto-drain-at-notice", "baseline"):
            if n in b:
                x = b[n]
                print(f"{b['unannounced_share']:<12.3f} {n:<32} {x['ettr']:6.4f} {x['waste_total_node_s'] / 3600:12.2f} "
                      f"{x['cost_per_sample'] * 1000:12.4f} {x['on_demand_cost_per_sample'] * 1000:10.4f}")
        if "best_fixed" in b:
            print(f"{'':<12} best fixed in hindsight {b['best_fixed']['interval_s']} s: auto/best waste "
                  f"{b['auto_vs_best_waste']:.3f}, auto/fixed50 waste {b['auto_vs_fixed50_waste']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
