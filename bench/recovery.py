"""Recovery from a spot preemption: trainguard vs plain ``torchrun`` elastic (benchmark, not a timed test).

Local "nodes" x 1 worker train the bundled byte-level GPT on CPU/gloo, everything on 127.0.0.1.
Runs of the same scenario, side by side in one invocation:

* **trainguard** (in place, DDP) -- two ``trainguard run`` agents training
  ``examples/train_gpt_elastic.py`` (worker API, periodic async checkpoints every
  ``--baseline-ckpt-every`` steps, ``workers.reform: in-process``). After ``--steps-before-notice``
  steps at world size 2 the AWS IMDSv2 emulator (``tests/emulators``) serves a spot ``instance-action``
  to node b: b drains (emergency checkpoint on every rank) and leaves, a's worker re-forms at world
  size 1 without a restart; after ``--steps-after`` steps b's agent is started again, warms its worker
  up, and the world grows to 2 (a pauses only for the re-formation). Every finished step's sample ids
  are logged (``--sample-log``) and checked against the global sample cursor's stream.
* **restart** -- the same with ``workers.reform: restart`` (every change restarts the workers, which
  restore from storage): today's fallback path, measured in the same run (``restart_*`` keys).
* **fsdp** -- the in-place run with ``--strategy fsdp`` (``fsdp_*`` keys; FSDP re-forms by reloading
  the checkpoint committed at the stop, resharded, when it re-forms in place at all).
* **kill** -- three in-place agents; one node is SIGKILLed without notice (agent and worker): the
  survivors' collectives fail, the interrupted step is rolled back and they re-form at world size 2
  (``kill_*`` keys).
* **hang_worker**, **freeze_node** (issue 37: dirty failures, nothing resets) -- three in-place agents
  as in **kill**; c's worker is SIGSTOPped (a hung rank: its agent alive) or c's agent and worker are
  (a frozen node). Figures side by side with the kill run: detection (the first agent line that acts:
  ``hang_detected`` or ``collectives_abort_requested``), the first step of the re-formed world (a hung
  rank's node restarts its worker and rejoins: world size 3; a frozen node is evicted: 2), steps lost,
  whether the survivors' worker pids are unchanged, samples skipped/repeated (``hang_worker_*``,
  ``freeze_node_*`` keys).
* **etcd**, **etcd-kill** (with ``--rdzv c10d,etcd`` or ``--rdzv etcd``) -- the in-place and the kill
  runs again, with the rendezvous in etcd v3 instead of node a's c10d store: etcd started by the
  bench on 127.0.0.1 with TLS, ``--client-cert-auth`` and RBAC, the agents logging in as the job's
  etcd user with a client certificate (the set-up of ``tests/fixtures/etcd.py``: run the bench from a
  checkout). ``etcd_*`` keys; with ``--rdzv etcd`` alone the c10d trainguard runs are skipped.
* **baseline** -- what users have today: two ``torchrun --nnodes 1:2`` (c10d) agents training
  ``examples/train_gpt.py`` with a ``torch.save`` checkpoint every K steps and no notice handling. At
  the same step node b dies the way a spot node does (its torchrun and worker are SIGKILLed, process
  groups and all); a's worker fails, torchrun restarts it from the last checkpoint at world size 1.
  Then b's torchrun is started again and the world grows to 2 (again from the last checkpoint).

Prints a timeline per run and a side-by-side table; ``--json PATH`` writes every figure (see
``docs/benchmarks.md`` for the definitions). Times are wall-clock seconds; worker lines carry no
timestamp of their own, so each output line is stamped when this process reads it (agent and worker
output goes through a pipe read by a thread; trainguard's worker lines also pass through the agent's
log tail, which polls every 0.1 s). The notice -> commit time uses the worker's own log timestamp.

Run: ``OMP_NUM_THREADS=1 python bench/recovery.py [--json out.json] [--keep] [--only SIDE]`` (several minutes).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tests.harness import alive, descendants, free_port, memory_root  # noqa: E402  (process helpers shared with the tests)
ELASTIC = os.path.join(REPO, "examples", "train_gpt_elastic.py")
PLAIN = os.path.join(REPO, "examples", "train_gpt.py")
GLOBAL_BATCH = 24
SEQ_LEN = 64  # both examples' default --seq-len
MAX_BYTES = 2_000_000  # both examples' default --max-bytes
SEED = 1234  # both examples' default --seed
STEP_SLEEP = 0.03
MONITOR_INTERVAL = 0.2  # agent/torchrun worker poll interval, the same for both
T0 = time.time()
_GLUED = re.compile(r"(?<=\})(?=\[[a-z]+\d+\]:|\{\")")


class BenchError(RuntimeError):
    pass


def say(who: str, text: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {who:<9} {text}", flush=True)


def iso_z(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def parse_ts(ev: dict[str, Any]) -> float | None:
    """Epoch seconds of a structlog ``timestamp`` (ISO 8601, UTC)."""
    ts = ev.get("timestamp")
    if not isinstance(ts, str):
        return None
    with contextlib.suppress(ValueError):
        return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
    return None


def wait_until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.05,
               procs: Iterable[Proc] = ()) -> Any:
    """Poll ``pred`` until truthy; ``BenchError`` after ``timeout`` s or when one of ``procs`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        for p in procs:
            if p.proc.poll() is not None:
                raise BenchError(f"{p.name} exited with {p.proc.returncode} while waiting for {what}")
        time.sleep(interval)
    raise BenchError(f"timed out after {timeout:.0f}s waiting for {what}")


# ---------------------------------------------------------------------------------------- IMDSv2
def imds() -> Any:
    """The AWS IMDSv2 emulator the tests use (``tests/emulators``), started."""
    from tests.emulators import AwsImdsEmulator

    return AwsImdsEmulator()


# ---------------------------------------------------------------------------------------- processes
def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """``sig`` to ``pid``, its descendants and their process groups (torch elastic starts each worker
    in a session of its own, so the launcher's group alone does not reach the workers)."""
    pids = [pid, *descendants(pid)]
    mine = os.getpgrp()
    for p in pids:
        with contextlib.suppress(OSError):
            pg = os.getpgid(p)
            if pg != mine:
                os.killpg(pg, sig)
        with contextlib.suppress(OSError):
            os.kill(p, sig)


def strays(marker: str) -> list[int]:
    """Live processes (other than this one) whose command line mentions ``marker`` (the work folder)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    if marker.encode() in fh.read() and alive(int(entry)):
                        out.append(int(entry))
    return out


def orphans(marker: str, grace: float = 5.0) -> int:
    """Processes of a run still alive ``grace`` s after its launchers exited (they should be none)."""
    deadline = time.monotonic() + grace
    while strays(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(strays(marker))


class Proc:
    """One node's launcher (trainguard agent or torchrun) in a session of its own. A thread reads its
    stdout+stderr (workers' output included) and stamps every line with its arrival time."""

    def __init__(self, name: str, cmd: list[str], log_path: str, env_extra: dict[str, str] | None = None) -> None:
        self.name = name
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
        env.update({"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1",
                    "GLOO_SOCKET_IFNAME": "lo", **(env_extra or {})})
        self._lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._fh = open(log_path, "w")
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()
        say(name, f"started (pid {self.proc.pid})")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            t = time.time()
            line = raw.decode(errors="replace").rstrip("\n")
            with self._lock:
                self._lines.append((t, line))
            self._fh.write(f"{line}\n")
            self._fh.flush()

    def events(self, name: str | None = None) -> list[tuple[float, dict[str, Any]]]:
        """``(arrival time, event)`` for each JSON line (agent events, and worker lines with the
        ``[default0]:`` tee prefix stripped)."""
        with self._lock:
            lines = list(self._lines)
        out = []
        for t, text in lines:
            # Agent and tee'd worker writes can land on one line: split "...}[default0]:{..." and "...}{...".
            for line in _GLUED.split(text):
                if line.startswith("[") and "]:" in line[:24]:
                    line = line.split("]:", 1)[1]
                if not line.startswith("{"):
                    continue
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if isinstance(ev, dict) and (name is None or ev.get("event") == name):
                    out.append((t, ev))
        return out

    def lines(self) -> list[tuple[float, str]]:
        with self._lock:
            return list(self._lines)

    def tail(self, n: int = 30) -> str:
        with self._lock:
            lines = [line for _, line in self._lines[-n:]]
        return f"--- {self.name} (last {len(lines)} lines) ---\n" + "\n".join(lines)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the launcher and everything under it; idempotent. Once the launcher is reaped its pid
        may belong to someone else, so only a live launcher's tree is walked (orphans that outlived it
        are left to the sweep over the work folder)."""
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._reader.join(5)
        self._fh.close()


def steps_of(nodes: Iterable[Proc]) -> list[tuple[float, dict[str, Any]]]:
    """Every ``train_step`` of every node, by arrival time."""
    return sorted((te for n in nodes for te in n.events("train_step")), key=lambda te: te[0])


def first(items: Iterable[tuple[float, dict[str, Any]]], pred: Callable[[float, dict[str, Any]], bool]) -> tuple[float, dict[str, Any]] | None:
    return next(((t, e) for t, e in items if pred(t, e)), None)


# ---------------------------------------------------------------------------------------- data accounting
def dataset_size() -> int:
    from trainguard.examples.train_gpt import load_corpus

    return (len(load_corpus(MAX_BYTES)) - 1) // SEQ_LEN


def cursor_stream(n_steps: int, n: int) -> list[int]:
    """The ids of steps 1..n_steps as the worker API's global sample cursor serves them."""
    from trainguard.runtime.cursor import GlobalSampleCursor

    c = GlobalSampleCursor(n, GLOBAL_BATCH, seed=SEED)
    return [i for _ in range(n_steps) for i in c.next_global_batch()]


def plain_batch(step: int, n: int, cache: dict[int, list[int]]) -> list[int]:
    """The ids ``examples/train_gpt.py`` trains on at finished step ``step`` (1-based), at any world size."""
    import torch

    per_epoch = n // GLOBAL_BATCH
    epoch, idx = divmod(step - 1, per_epoch)
    if epoch not in cache:
        cache[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(SEED * 1000 + epoch)).tolist()
    return cache[epoch][idx * GLOBAL_BATCH:(idx + 1) * GLOBAL_BATCH]


def account(batches: list[list[int]], expected: list[int]) -> dict[str, int]:
    """``repeated``: extra uses of ids used more than once; ``skipped``: ids of the expected stream
    (steps 1..max) never used; ``unexpected``: ids used that are not in it."""
    seen = collections.Counter(i for b in batches for i in b)
    exp = set(expected)
    return {"repeated": sum(c - 1 for c in seen.values() if c > 1), "skipped": len(exp - set(seen)),
            "unexpected": len(set(seen) - exp), "consumed": sum(seen.values())}


def read_sample_log(folder: str) -> list[dict[str, Any]]:
    """Every (non rolled-back) step record of the bundled job's sample log."""
    sys.path.insert(0, REPO)
    from tests import samples

    return [r for r in samples.read(folder) if not r.get("rolled_back")]


def committed(folder: str) -> dict[int, dict[str, Any]]:
    """step -> the one committed attempt (``tests/samples.py``)."""
    sys.path.insert(0, REPO)
    from tests import samples

    return samples.committed_batches(folder)


def worker_pid(node: Proc) -> int | None:
    """The pid of the node's (one) training worker process."""
    for pid in descendants(node.proc.pid):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if ELASTIC.encode() in fh.read() and alive(pid):
                    return pid
    return None


# ---------------------------------------------------------------------------------------- trainguard run
RDZV_PREFIX = {"c10d": "", "etcd": "etcd_"}
"""JSON key prefix of the trainguard runs on each rendezvous backend (c10d keeps the historical names)."""


@contextlib.contextmanager
def rendezvous_for(rdzv: str, d: str) -> Any:
    """``(flags for every agent, extra flags for node a, extra flags for the others)`` on backend
    ``rdzv``: c10d hosted by node a, or a secured etcd v3 that runs until the block exits."""
    if rdzv == "c10d":
        ep = f"127.0.0.1:{free_port()}"
        yield (["--rdzv-backend", "c10d", "--rdzv-endpoint", ep, "--rdzv-id", "bench"],
               ["--set", "rendezvous.is_host=true"], ["--set", "rendezvous.is_host=false"])
        return
    sys.path.insert(0, REPO)  # the secured-etcd set-up of the test suite (certificates, users, roles)
    from tests.fixtures.etcd import start_secure_etcd

    # Beside the run's folder, not in it: etcd is no orphan of the run (see `orphans`).
    with start_secure_etcd(Path(os.path.dirname(d)) / f"etcd-server-{os.path.basename(d)}", job="bench") as etcd:
        say("bench", f"etcd v3 with TLS, client certificates and RBAC at {etcd.endpoint}")
        yield ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", "bench", *etcd.set_flags()], [], []


def _agent_factory(d: str, rdzv: list[str], common: list[str], args: list[str], procs: list[Proc],
                   timeline: list[tuple[float, str, str]], nnodes: str = "1:2"):
    def agent(name: str, extra: list[str]) -> Proc:
        cmd = [sys.executable, "-m", "trainguard.agent.cli", "run", "--nnodes", nnodes, "--nproc-per-node", "1",
               *rdzv, "--node-name", name,
               "--local-addr", "127.0.0.1", "--monitor-interval", str(MONITOR_INTERVAL),
               "--state-dir", os.path.join(d, f"state-{name}"), "--log-dir", os.path.join(d, f"logs-{name}"),
               "--set", "agent.log_format=json", "--set", "metrics.port=0",
               "--set", f"checkpoint.memory_dir={memory_root(d)}",  # tier 0 (on by default): this run's own folder
               *common, *extra, ELASTIC, *args]
        p = Proc(f"tg-{name}", cmd, os.path.join(d, f"{name}.log"))
        procs.append(p)
        timeline.append((p.started, p.name, "agent started"))
        return p

    return agent


def _continued(node: Proc, world: int) -> list[tuple[float, dict[str, Any]]]:
    """``resumed`` (a restart restored) or ``reformed`` (in place) at ``world`` on the node's rank 0."""
    return [(t, e) for t, e in node.events() if e.get("event") in ("resumed", "reformed") and e.get("world_size") == world]


def run_trainguard(a: argparse.Namespace, work: str, procs: list[Proc], timeline: list[tuple[float, str, str]], *,
                   reform: str = "in-process", strategy: str = "ddp", prefix: str = "", rdzv: str = "c10d") -> dict[str, Any]:
    d = os.path.join(work, f"trainguard-{prefix or 'inplace'}")
    with rendezvous_for(rdzv, d) as flags:
        return _run_trainguard(a, d, procs, timeline, flags, reform=reform, strategy=strategy, prefix=prefix)


def _run_trainguard(a: argparse.Namespace, d: str, procs: list[Proc], timeline: list[tuple[float, str, str]],
                    flags: tuple[list[str], list[str], list[str]], *, reform: str, strategy: str, prefix: str) -> dict[str, Any]:
    rdzv, rdzv_first, rdzv_others = flags
    samples = os.path.join(d, "samples")
    os.makedirs(samples)
    emu = imds()
    res: dict[str, Any] = {}
    args = ["--steps", "1000000", "--log-every", "1", "--step-sleep", str(STEP_SLEEP), "--global-batch",
            str(GLOBAL_BATCH), "--sample-log", samples, "--strategy", strategy]
    common = ["--set", f"checkpoint.url={os.path.join(d, 'ckpt')}", "--set", f"checkpoint.interval={a.baseline_ckpt_every}",
              "--set", f"workers.reform={reform}"]
    aws = ["--set", "preemption.sources=aws,signal", "--set", f"preemption.aws_endpoint={emu.url}",
           "--set", "preemption.poll_interval_s=0.5",
           "--set", "preemption.train_through_notice=false"]  # measures the drain at the notice
    agent = _agent_factory(d, rdzv, common, args, procs, timeline)

    try:
        na = agent("a", ["--set", "preemption.sources=signal", *rdzv_first])
        time.sleep(0.5)
        nb = agent("b", [*aws, *rdzv_others])
        nodes = [na, nb]
        t_w2, _ = wait_until(lambda: first(steps_of(nodes), lambda t, e: e["world_size"] == 2), 120,
                             "the first step at world size 2", procs=nodes)
        timeline.append((t_w2, "trainguard", "first step at world size 2"))
        wait_until(lambda: first(steps_of(nodes), lambda t, e: e["world_size"] == 2 and e["step"] >= a.steps_before_notice),
                   120, f"{a.steps_before_notice} steps at world size 2", procs=nodes)
        pid_start = worker_pid(na)

        t_notice = time.time()
        emu.schedule_termination(in_s=120)  # the spot two-minute warning, for node b only
        say("bench", f"[{prefix or 'in place'}] AWS spot notice for node b (terminate in 120 s)")
        timeline.append((t_notice, "bench", "AWS spot notice served to node b (deadline +120 s)"))
        before = [e for t, e in steps_of(nodes) if t <= t_notice]
        res["world_size_before"] = before[-1]["world_size"] if before else None
        res["b_exit_code"] = nb.wait(90)
        timeline.append((time.time(), nb.name, f"agent exited with {res['b_exit_code']}"))
        for t, e in nb.events("preemption_notice"):
            res["notice_detected_s"] = round((parse_ts(e) or t) - t_notice, 3)
            timeline.append((parse_ts(e) or t, nb.name, f"preemption_notice source={e.get('source')} kind={e.get('kind')}"))
            break
        commits = [(parse_ts(e) or t, e) for n in nodes for t, e in n.events("checkpoint_committed")
                   if e.get("kind") == "emergency" and e.get("component") == "trainguard.worker"]
        if commits:
            t_commit = max(t for t, _ in commits)
            res["notice_to_commit_s"] = round(t_commit - t_notice, 3)
            res["emergency_step"] = commits[0][1]["step"]
            res["emergency_before_deadline"] = all(e.get("before_deadline") for _, e in commits)
            res["emergency_ranks"] = len(commits)
            timeline.append((t_commit, "workers", f"emergency checkpoint committed at step {res['emergency_step']} "
                                                  f"on {len(commits)} rank(s) ({commits[0][1].get('seconds')} s)"))

        t_resume, ev1 = wait_until(lambda: first(steps_of([na]), lambda t, e: t > t_notice and e["world_size"] == 1), 120,
                                   "the survivor's first step at world size 1", procs=[na])
        # Snapshot the sample log now: every world-2 record in it was trained before the notice.
        w2_before = [r["step"] for r in read_sample_log(samples) if r["world_size"] == 2]
        cont = _continued(na, 1)
        res["notice_to_resume_s"] = round(t_resume - t_notice, 3)
        res["world_size_after"] = ev1["world_size"]
        res["resumed_step"] = cont[0][1]["step"] if cont else ev1["step"] - 1
        res["resize_path"] = cont[0][1]["event"] if cont else None
        if cont:
            timeline.append((cont[0][0], na.name, f"worker {cont[0][1]['event']} from step {res['resumed_step']} at world size 1"))
        for key, event, pred, text in (
                ("notice_to_rendezvous_s", "rendezvous_complete", lambda e: e.get("world_size") == 1, "rendezvous complete at world size 1"),
                ("notice_to_worker_up_s", "worker_registered", lambda e: True, "new worker process up (registered with the agent)"),
                ("notice_to_restored_s", "worker_restored", lambda e: True, ""),
                ("notice_to_reformed_s", "worker_reformed", lambda e: e.get("world_size") == 1, "worker re-formed in place")):
            ts = [t for t in (parse_ts(e) for _, e in na.events(event) if pred(e)) if t and t > t_notice]
            if ts:
                res[key] = round(ts[0] - t_notice, 3)
                if text:
                    timeline.append((ts[0], na.name, text))
        res["last_step_before_notice"] = max(w2_before) if w2_before else None
        res["lost_steps"] = max(0, max(w2_before) - res["resumed_step"]) if w2_before else None
        timeline.append((t_resume, na.name, f"step {ev1['step']} at world size 1 (first after the change)"))
        say("bench", f"survivor at world size 1, step {ev1['step']} ({res['notice_to_resume_s']:.2f} s after the notice)")
        wait_until(lambda: first(steps_of([na]), lambda t, e: e["world_size"] == 1 and e["step"] >= ev1["step"] + a.steps_after),
                   120, f"{a.steps_after} steps at world size 1", procs=[na])

        emu.clear()
        nb2 = agent("b2", [*aws, *rdzv_others])
        nodes = [na, nb2]
        t_join = nb2.started
        t_up, ev2 = wait_until(lambda: first(steps_of(nodes), lambda t, e: t > t_join and e["world_size"] == 2), 120,
                               "the first step at world size 2 after b rejoined", procs=nodes)
        res["scaleup_join_to_resume_s"] = round(t_up - t_join, 3)
        w1 = [(t, e) for t, e in steps_of([na]) if e["world_size"] == 1 and t <= t_up]
        last_w1 = max(e["step"] for _, e in w1)
        res["scaleup_stall_s"] = round(t_up - max(t for t, _ in w1), 3)  # survivor: last step at 1 -> first at 2
        warm = [parse_ts(e) for _, e in nb2.events("joiner_warm")]
        if warm and warm[0]:
            res["joiner_ready_s"] = round(warm[0] - t_join, 3)
            timeline.append((warm[0], nb2.name, "joiner's worker warm (started, imported, model built)"))
        res["scaleup_lost_steps"] = max(0, last_w1 - (ev2["step"] - 1))
        timeline.append((t_up, "trainguard", f"step {ev2['step']} at world size 2 (first after the rejoin)"))
        say("bench", f"world size 2 again at step {ev2['step']} ({res['scaleup_join_to_resume_s']:.1f} s after b's agent "
                     f"started, survivor stalled {res['scaleup_stall_s']:.2f} s)")
        wait_until(lambda: first(steps_of(nodes), lambda t, e: e["world_size"] == 2 and e["step"] >= ev2["step"] + a.steps_after),
                   120, f"{a.steps_after} steps at world size 2", procs=nodes)
        res["same_worker_pids"] = pid_start is not None and worker_pid(na) == pid_start

        t_stop = time.time()
        for n in nodes:
            n.proc.send_signal(signal.SIGTERM)
        res["final_exit_codes"] = {n.name: n.wait(60) for n in nodes}
        res["stop_s"] = round(time.time() - t_stop, 3)
        res["orphans_after_stop"] = orphans(d)
        timeline.append((time.time(), "bench", f"SIGTERM to both agents: exit codes {res['final_exit_codes']}"))

        steps = committed(samples)
        max_step = max(steps)
        acc = account([steps[s]["ids"] for s in sorted(steps)], cursor_stream(max_step, dataset_size()))
        res.update(skipped_samples=acc["skipped"], repeated_samples=acc["repeated"], unexpected_samples=acc["unexpected"],
                   samples_consumed=acc["consumed"], steps_trained=max_step,
                   global_batch_constant=all(len(v["ids"]) == GLOBAL_BATCH for v in steps.values()))
        return {f"{prefix}{k}": v for k, v in res.items()}
    finally:
        emu.close()


def run_kill(a: argparse.Namespace, work: str, procs: list[Proc], timeline: list[tuple[float, str, str]], *,
             rdzv: str = "c10d", prefix: str = "") -> dict[str, Any]:
    """Three in-place agents; node c is SIGKILLed (agent and worker) without notice."""
    d = os.path.join(work, f"trainguard-{prefix}kill")
    with rendezvous_for(rdzv, d) as flags:
        return {f"{prefix}{k}": v for k, v in _run_kill(a, d, procs, timeline, flags).items()}


def _three_nodes(a: argparse.Namespace, d: str, procs: list[Proc], timeline: list[tuple[float, str, str]],
                 flags: tuple[list[str], list[str], list[str]]) -> tuple[list[Proc], str]:
    """Nodes a (hosting the c10d store), b and c training in place with a sample log, until
    ``--steps-before-notice`` steps at world size 3; returns them and the sample-log folder."""
    rdzv, rdzv_first, rdzv_others = flags
    samples = os.path.join(d, "samples")
    os.makedirs(samples)
    args = ["--steps", "1000000", "--log-every", "1", "--step-sleep", str(STEP_SLEEP), "--global-batch",
            str(GLOBAL_BATCH), "--sample-log", samples]
    common = ["--set", f"checkpoint.url={os.path.join(d, 'ckpt')}", "--set", f"checkpoint.interval={a.baseline_ckpt_every}",
              "--set", "preemption.sources=signal"]
    agent = _agent_factory(d, rdzv, common, args, procs, timeline, nnodes="1:3")
    na = agent("a", rdzv_first)
    time.sleep(0.5)
    nodes = [na, agent("b", rdzv_others), agent("c", rdzv_others)]
    wait_until(lambda: first(steps_of(nodes), lambda t, e: e["world_size"] == 3 and e["step"] >= a.steps_before_notice),
               180, f"{a.steps_before_notice} steps at world size 3", procs=nodes)
    return nodes, samples


def _run_kill(a: argparse.Namespace, d: str, procs: list[Proc], timeline: list[tuple[float, str, str]],
              flags: tuple[list[str], list[str], list[str]]) -> dict[str, Any]:
    nodes, samples = _three_nodes(a, d, procs, timeline, flags)
    na, nb, nc = nodes
    res: dict[str, Any] = {}
    pid_start = worker_pid(na)
    t_kill = time.time()
    nc.kill()
    say("bench", "node c dies without notice: SIGKILL to its agent and worker")
    timeline.append((t_kill, "bench", "node c killed (SIGKILL, agent and worker)"))
    last_before = max(e["step"] for t, e in steps_of(nodes) if t <= t_kill)
    t_resume, ev = wait_until(lambda: first(steps_of([na, nb]), lambda t, e: t > t_kill and e["world_size"] == 2), 120,
                              "the survivors' first step at world size 2", procs=[na, nb])
    cont = _continued(na, 2)
    resumed_from = cont[0][1]["step"] if cont else ev["step"] - 1
    res.update(kill_to_resume_s=round(t_resume - t_kill, 3), kill_lost_steps=max(0, last_before - resumed_from),
               kill_resize_path=cont[0][1]["event"] if cont else None,
               kill_same_worker_pids=pid_start is not None and worker_pid(na) == pid_start)
    lost = [parse_ts(e) for _, e in na.events("peer_lost")]
    if lost and lost[0]:
        res["kill_detected_s"] = round(lost[0] - t_kill, 3)
        timeline.append((lost[0], na.name, "worker: a collective failed (peer lost)"))
    timeline.append((t_resume, "trainguard", f"step {ev['step']} at world size 2 (first after the kill)"))
    say("bench", f"survivors at world size 2, step {ev['step']} ({res['kill_to_resume_s']:.2f} s after the kill)")
    wait_until(lambda: first(steps_of([na, nb]), lambda t, e: e["world_size"] == 2 and e["step"] >= ev["step"] + 10),
               120, "10 steps at world size 2", procs=[na, nb])
    res.update({f"kill_{k}": v for k, v in _stop_and_account([na, nb], samples).items()})
    return res


def _stop_and_account(survivors: list[Proc], samples: str) -> dict[str, int]:
    """Stop the survivors (a drain each) and check the sample log against the cursor's stream."""
    for n in survivors:
        n.proc.send_signal(signal.SIGTERM)
    for n in survivors:
        n.wait(60)
    steps = committed(samples)
    acc = account([steps[s]["ids"] for s in sorted(steps)], cursor_stream(max(steps), dataset_size()))
    return {"skipped_samples": acc["skipped"], "repeated_samples": acc["repeated"]}


def run_fault(a: argparse.Namespace, work: str, procs: list[Proc], timeline: list[tuple[float, str, str]], *,
              kind: str, rdzv: str = "c10d") -> dict[str, Any]:
    """Three in-place agents; a dirty fault on node c (no reset): ``hang_worker`` SIGSTOPs c's worker
    (its agent alive), ``freeze_node`` SIGSTOPs c's agent and worker (a frozen node)."""
    d = os.path.join(work, f"trainguard-{kind}")
    with rendezvous_for(rdzv, d) as flags:
        return {f"{kind}_{k}": v for k, v in _run_fault(a, d, procs, timeline, flags, kind).items()}


def _run_fault(a: argparse.Namespace, d: str, procs: list[Proc], timeline: list[tuple[float, str, str]],
               flags: tuple[list[str], list[str], list[str]], kind: str) -> dict[str, Any]:
    nodes, samples = _three_nodes(a, d, procs, timeline, flags)
    na, nb, nc = nodes
    res: dict[str, Any] = {}
    pids = (worker_pid(na), worker_pid(nb))
    culprit = worker_pid(nc)
    stopped = [culprit] if kind == "hang_worker" else [nc.proc.pid, *descendants(nc.proc.pid)]
    t_fault = time.time()
    for pid in stopped:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGSTOP)
    what = "c's worker SIGSTOPped (hung rank, agent alive)" if kind == "hang_worker" else "node c SIGSTOPped (agent and worker)"
    say("bench", what)
    timeline.append((t_fault, "bench", what))
    try:
        last_before = max(e["step"] for t, e in steps_of(nodes) if t <= t_fault)
        # Detected: the first agent line that acts on it (hang_detected, or the abort after the keep-alive).
        acting = ("hang_detected", "collectives_abort_requested")

        def detected() -> list[tuple[float, str, dict[str, Any]]]:
            return sorted((parse_ts(e) or t, n.name, e) for n in nodes for t, e in n.events()
                          if e.get("event") in acting and t >= t_fault)

        t_det, who, ev = wait_until(detected, 120, "the fault detected", procs=[na, nb])[0]
        res["detect_s"] = round(t_det - t_fault, 3)
        res["detected_by"] = ev.get("event") if ev.get("event") != "hang_detected" else f"hang_detected/{ev.get('action')}"
        timeline.append((t_det, who, f"{ev.get('event')} {ev.get('action', ev.get('reason', ''))} "
                                     f"rank={ev.get('rank')} phase={ev.get('phase')}"))
        world = 3 if kind == "hang_worker" else 2  # a hung rank's node rejoins; a frozen node is evicted

        def reformed() -> tuple[float, dict[str, Any]] | None:
            marks = [parse_ts(e) or t for n in (na, nb) for t, e in n.events("reformed_in_place") if t >= t_fault]
            if not marks:
                return None
            return first(steps_of([na, nb, nc]), lambda t, e: t > min(marks) and e["world_size"] == world)

        t_resume, evs = wait_until(reformed, 120, f"the first step of the re-formed world ({world} ranks)", procs=[na, nb])
        cont = _continued(na, world) + _continued(nb, world)
        after = [e["step"] for t, e in cont if t >= t_fault]  # the script's line has no timestamp: its arrival
        resumed_from = min(after) if after else evs["step"] - 1
        res.update(to_resume_s=round(t_resume - t_fault, 3), lost_steps=max(0, last_before - resumed_from),
                   same_worker_pids=pids[0] is not None and (worker_pid(na), worker_pid(nb)) == pids,
                   world_size_after=world)
        timeline.append((t_resume, "trainguard", f"step {evs['step']} at world size {world} (first of the re-formed world)"))
        say("bench", f"{kind}: detected after {res['detect_s']:.2f} s, first step of the re-formed world "
                     f"{res['to_resume_s']:.2f} s after the fault")
        wait_until(lambda: first(steps_of([na, nb]), lambda t, e: e["world_size"] == world and e["step"] >= evs["step"] + 10),
                   120, "10 more steps", procs=[na, nb])
    finally:
        for pid in stopped:  # a frozen node wakes up before it is stopped (SIGKILL reaches it either way)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
    nc.kill()
    res.update(_stop_and_account([na, nb], samples))
    return res


# ---------------------------------------------------------------------------------------- baseline
def run_baseline(a: argparse.Namespace, work: str, procs: list[Proc], timeline: list[tuple[float, str, str]]) -> dict[str, Any]:
    d = os.path.join(work, "baseline")
    ckpt = os.path.join(d, "ckpt")
    os.makedirs(d)
    ep = f"127.0.0.1:{free_port()}"
    res: dict[str, Any] = {}

    def torchrun(name: str, is_host: bool) -> Proc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", ep, "--rdzv-id", "bench-baseline",
               "--rdzv-conf", f"is_host={int(is_host)}", "--max-restarts", "3", "--local-addr", "127.0.0.1",
               "--monitor-interval", str(MONITOR_INTERVAL), PLAIN, "--steps", "1000000", "--ckpt-dir", ckpt,
               "--ckpt-every", str(a.baseline_ckpt_every), "--global-batch", str(GLOBAL_BATCH),
               "--step-sleep", str(STEP_SLEEP), "--log-every", "1"]
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if a.baseline_unshared_store else None
        p = Proc(f"base-{name}", cmd, os.path.join(d, f"{name}.log"), env)
        procs.append(p)
        timeline.append((p.started, p.name, "torchrun started"))
        return p

    na = torchrun("a", True)
    time.sleep(0.5)
    nb = torchrun("b", False)
    nodes = [na, nb]
    t_w2, _ = wait_until(lambda: first(steps_of(nodes), lambda t, e: e["world_size"] == 2), 120,
                         "the first step at world size 2", procs=nodes)
    timeline.append((t_w2, "baseline", "first step at world size 2"))
    wait_until(lambda: first(steps_of(nodes), lambda t, e: e["world_size"] == 2 and e["step"] >= a.steps_before_notice),
               120, f"{a.steps_before_notice} steps at world size 2", procs=nodes)

    # No notice handling: the node is simply gone (at the deadline; the clock starts there, deadline 0).
    t_kill = time.time()
    nb.kill()
    say("bench", "node b dies: SIGKILL to its torchrun and worker")
    timeline.append((t_kill, "bench", "node b killed (SIGKILL, process groups)"))
    before = [e for t, e in steps_of(nodes) if t <= t_kill]
    res["baseline_world_size_before"] = before[-1]["world_size"] if before else None

    t_resume, ev1 = wait_until(lambda: first(steps_of([na]), lambda t, e: t > t_kill and e["world_size"] == 1), 180,
                               "node a's first step at world size 1", procs=[na])
    last_before = max(e["step"] for _, e in steps_of(nodes) if e["world_size"] == 2)
    resumed = [(t, e) for t, e in na.events("resumed") if e["world_size"] == 1]
    res["baseline_notice_to_resume_s"] = round(t_resume - t_kill, 3)
    res["baseline_world_size_after"] = ev1["world_size"]
    res["baseline_resumed_step"] = resumed[0][1]["step"] if resumed else ev1["step"] - 1
    res["baseline_last_step_before_notice"] = last_before
    failed = [t for t, line in na.lines() if t > t_kill and "failed (exitcode" in line]
    if failed:
        res["baseline_failure_detected_s"] = round(failed[0] - t_kill, 3)
        timeline.append((failed[0], na.name, "torchrun: local worker failed (gloo peer gone); restarting via rendezvous"))
    res["baseline_lost_steps"] = max(0, last_before - res["baseline_resumed_step"])
    if resumed:
        timeline.append((resumed[0][0], na.name, f"worker restarted from checkpoint step {res['baseline_resumed_step']} at world size 1"))
    timeline.append((t_resume, na.name, f"step {ev1['step']} at world size 1 (first after the restart)"))
    say("bench", f"node a resumed at world size 1, step {ev1['step']} ({res['baseline_notice_to_resume_s']:.1f} s after the kill)")
    wait_until(lambda: first(steps_of([na]), lambda t, e: e["world_size"] == 1 and e["step"] >= ev1["step"] + a.steps_after),
               120, f"{a.steps_after} steps at world size 1", procs=[na])

    nb2 = torchrun("b2", False)
    nodes = [na, nb2]
    t_join = nb2.started
    try:
        t_up, ev2 = wait_until(lambda: first(steps_of(nodes), lambda t, e: t > t_join and e["world_size"] == 2), 180,
                               "the first step at world size 2 after b rejoined", procs=nodes)
        last_w1 = max(e["step"] for t, e in steps_of([na]) if e["world_size"] == 1 and t <= t_up)
        res["baseline_scaleup_join_to_resume_s"] = round(t_up - t_join, 3)
        res["baseline_scaleup_lost_steps"] = max(0, last_w1 - (ev2["step"] - 1))
        timeline.append((t_up, "baseline", f"step {ev2['step']} at world size 2 (first after the rejoin)"))
        say("bench", f"world size 2 again at step {ev2['step']} ({res['baseline_scaleup_join_to_resume_s']:.1f} s after b's torchrun started)")
        wait_until(lambda: first(steps_of(nodes), lambda t, e: e["world_size"] == 2 and e["step"] >= ev2["step"] + a.steps_after),
                   120, f"{a.steps_after} steps at world size 2", procs=nodes)
    except BenchError as e:  # a finding, not a bench failure: plain torchrun may not survive a scale-up
        res["baseline_scaleup_error"] = str(e)
        timeline.append((time.time(), "baseline", f"scale-up failed: {e}"))
        say("bench", f"baseline scale-up failed: {e}")
        for n in nodes:
            errs = [line for _, line in n.lines() if "Error" in line and not line.lstrip().startswith(("File", "[rank"))]
            if errs:
                res.setdefault("baseline_scaleup_failure", {})[n.name] = errs[-1][:300]
    for n in nodes:
        if n.proc.poll() is None:
            n.proc.send_signal(signal.SIGTERM)
    res["baseline_final_exit_codes"] = {}
    for n in nodes:
        try:
            res["baseline_final_exit_codes"][n.name] = n.wait(60)
        except subprocess.TimeoutExpired:
            res["baseline_final_exit_codes"][n.name] = None
    res["baseline_orphans_after_stop"] = orphans(d)

    # Every finished step is logged once by rank 0 (--log-every 1); train_gpt.py maps a step to its
    # batch whatever the world size, so the ids follow from the step numbers.
    n = dataset_size()
    cache: dict[int, list[int]] = {}
    trained = [e["step"] for _, e in steps_of([na, nb, nb2])]
    max_step = max(trained)
    acc = account([plain_batch(s, n, cache) for s in trained], [i for s in range(1, max_step + 1) for i in plain_batch(s, n, cache)])
    res.update(baseline_skipped_samples=acc["skipped"], baseline_repeated_samples=acc["repeated"],
               baseline_samples_consumed=acc["consumed"], baseline_steps_trained=max_step)
    return res


# ---------------------------------------------------------------------------------------- report
ROWS = [
    # (field, target text, predicate on the trainguard value); the restart/fsdp/baseline columns show the
    # same field of those runs (restart_<field>, fsdp_<field>, baseline_<field>).
    ("notice_to_commit_s", "", None),
    ("notice_to_resume_s", "<= 1.0 (ddp in place)", lambda v: v is not None and v <= 1.0),
    ("lost_steps", "== 0", lambda v: v == 0),
    ("skipped_samples", "== 0", lambda v: v == 0),
    ("repeated_samples", "== 0", lambda v: v == 0),
    ("world_size_before", "", None),
    ("world_size_after", "", None),
    ("scaleup_join_to_resume_s", "", None),
    ("scaleup_stall_s", "<= 1.5", lambda v: v is not None and v <= 1.5),
    ("joiner_ready_s", "", None),
    ("scaleup_lost_steps", "", None),
    ("same_worker_pids", "true", lambda v: v is True),
]
SINGLE = [
    # (field, target text, predicate) of the runs without a baseline column
    ("fsdp_notice_to_resume_s", "<= 2.0", lambda v: v is not None and v <= 2.0),
    ("kill_to_resume_s", "<= 2", lambda v: v is not None and v <= 2.0),
    ("kill_lost_steps", "<= 1", lambda v: v is not None and v <= 1),
    ("kill_skipped_samples", "== 0", lambda v: v == 0),
    ("kill_repeated_samples", "== 0", lambda v: v == 0),
    ("kill_same_worker_pids", "true", lambda v: v is True),
]
FAULTS = [
    # (field, target text per kind {kind: (text, predicate)}); one column per fault kind, side by side
    ("detect_s", {"hang_worker": ("<= 10", lambda v: v is not None and v <= 10.0), "freeze_node": ("", None),
                  "kill": ("", None)}),
    ("to_resume_s", {"hang_worker": ("<= 15", lambda v: v is not None and v <= 15.0),
                     "freeze_node": ("<= 15", lambda v: v is not None and v <= 15.0),
                     "kill": ("<= 2", lambda v: v is not None and v <= 2.0)}),
    ("lost_steps", {"hang_worker": ("<= 1", lambda v: v is not None and v <= 1),
                    "freeze_node": ("<= 1", lambda v: v is not None and v <= 1), "kill": ("<= 1", lambda v: v is not None and v <= 1)}),
    ("same_worker_pids", {k: ("true", lambda v: v is True) for k in ("hang_worker", "freeze_node", "kill")}),
    ("skipped_samples", {k: ("== 0", lambda v: v == 0) for k in ("hang_worker", "freeze_node", "kill")}),
    ("repeated_samples", {k: ("== 0", lambda v: v == 0) for k in ("hang_worker", "freeze_node", "kill")}),
    ("world_size_after", {k: ("", None) for k in ("hang_worker", "freeze_node", "kill")}),
    ("detected_by", {k: ("", None) for k in ("hang_worker", "freeze_node", "kill")}),
]
"""The dirty-fault table (issue 37): the kill run's figures are its ``kill_*`` keys (``kill_to_resume_s``
is the SIGKILL target of 2 s, ``kill_detected_s`` its detection)."""


def fault_value(res: dict[str, Any], kind: str, field: str) -> Any:
    if kind == "kill":
        return res.get("kill_detected_s" if field == "detect_s" else f"kill_{field}",
                       2 if field == "world_size_after" and "kill_to_resume_s" in res else None)
    return res.get(f"{kind}_{field}")


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def print_timeline(title: str, timeline: list[tuple[float, str, str]]) -> None:
    if not timeline:
        return
    t0 = min(t for t, _, _ in timeline)
    print(f"\n{title} timeline")
    for t, who, text in sorted(timeline):
        print(f"  {t - t0:7.2f}s  {who:<10} {text}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    ap.add_argument("--steps-before-notice", type=int, default=30, help="steps at world size 2 before the notice")
    ap.add_argument("--steps-after", type=int, default=40, help="steps trained after each resize before the next action")
    ap.add_argument("--baseline-ckpt-every", type=int, default=20,
                    help="checkpoint every K steps (baseline torch.save; trainguard periodic checkpoint.interval)")
    ap.add_argument("--baseline-unshared-store", action="store_true",
                    help="baseline only: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (torch 2.13's workaround for the "
                         "scale-up store bug, see agent/supervisor.py); default: torchrun as installed")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs, checkpoints, sample logs)")
    ap.add_argument("--only", choices=["trainguard", "restart", "fsdp", "kill", "hang_worker", "freeze_node", "etcd",
                                       "etcd-kill", "baseline"],
                    action="append", default=None, help="run only these sides (repeatable)")
    ap.add_argument("--rdzv", default="c10d", metavar="BACKENDS",
                    help="rendezvous backend(s) of the trainguard runs, comma-separated: c10d (default: node a hosts "
                         "the store), etcd (v3 with TLS + client certificates + RBAC, started by the bench: adds the "
                         "etcd and etcd-kill runs), or c10d,etcd side by side")
    a = ap.parse_args(argv)
    backends = [b.strip() for b in a.rdzv.split(",") if b.strip()]
    if not backends or any(b not in RDZV_PREFIX for b in backends):
        ap.error(f"--rdzv: choose from {sorted(RDZV_PREFIX)}, comma-separated; got {a.rdzv!r}")

    # A SIGTERM to the bench unwinds through the finally blocks below, which kill what it started.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    work = tempfile.mkdtemp(prefix="tg-bench-recovery-")
    procs: list[Proc] = []
    res: dict[str, Any] = {"steps_before_notice": a.steps_before_notice, "steps_after": a.steps_after,
                           "ckpt_every": a.baseline_ckpt_every, "global_batch": GLOBAL_BATCH, "step_sleep_s": STEP_SLEEP,
                           "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cpus": os.cpu_count(),
                           "baseline_unshared_store": a.baseline_unshared_store}
    errors: dict[str, str] = {}
    print(f"recovery benchmark: work folder {work}", flush=True)
    try:
        sides = (("trainguard", run_trainguard),
                 ("restart", functools.partial(run_trainguard, reform="restart", prefix="restart_")),
                 ("fsdp", functools.partial(run_trainguard, strategy="fsdp", prefix="fsdp_")),
                 ("kill", run_kill),
                 ("hang_worker", functools.partial(run_fault, kind="hang_worker")),
                 ("freeze_node", functools.partial(run_fault, kind="freeze_node")),
                 ("etcd", functools.partial(run_trainguard, prefix="etcd_", rdzv="etcd")),
                 ("etcd-kill", functools.partial(run_kill, prefix="etcd_", rdzv="etcd")),
                 ("baseline", run_baseline))
        res["rdzv_backends"] = backends
        for side, fn in sides:
            if a.only and side not in a.only:
                continue
            on_etcd = side.startswith("etcd")
            if (on_etcd and "etcd" not in backends) or (side != "baseline" and not on_etcd and "c10d" not in backends):
                continue
            timeline: list[tuple[float, str, str]] = []
            mine: list[Proc] = []
            try:
                res.update(fn(a, work, mine, timeline))
            except Exception as e:  # one side failing must not lose the other's figures
                errors[side] = f"{type(e).__name__}: {e}"
                say("bench", f"{side} run FAILED: {errors[side]}")
                for p in mine:
                    print(p.tail(40), flush=True)
            finally:
                for p in mine:
                    p.kill()
                procs += mine
                for pid in strays(work):  # orphans of launchers that exited on their own
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
            print_timeline(side, timeline)
    finally:
        for p in procs:
            with contextlib.suppress(Exception):
                p.kill()
        left = strays(work)
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        res["leftover_processes"] = len(left)
        for name in os.listdir(work):  # SIGKILLed agents leave their tier-0 folders
            shutil.rmtree(memory_root(os.path.join(work, name)), ignore_errors=True)
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)

    etcd_rows = [(f"etcd_{f}", text, ok) for f, text, ok in [*ROWS, *SINGLE] if not f.startswith("fsdp_")]
    targets = {}
    for field, text, ok in [*ROWS, *SINGLE, *etcd_rows]:
        if ok is not None and field in res:
            targets[field] = {"target": text, "value": res.get(field), "met": bool(ok(res.get(field)))}
    if "notice_to_resume_s" in res and "restart_notice_to_resume_s" in res:
        res["restart_over_inplace_resume_ratio"] = round(res["restart_notice_to_resume_s"] / res["notice_to_resume_s"], 2)
    kinds = [k for k in ("kill", "hang_worker", "freeze_node") if any(fault_value(res, k, f) is not None for f, _ in FAULTS)]
    for field, per_kind in FAULTS:
        for k in kinds:
            text, ok = per_kind[k]
            v = fault_value(res, k, field)
            if ok is not None and v is not None and f"{k}_{field}" not in targets:
                targets[f"{k}_{field}"] = {"target": text, "value": v, "met": bool(ok(v))}
    res["targets"] = targets
    res["targets_met"] = all(t["met"] for t in targets.values()) and not errors
    if errors:
        res["errors"] = errors

    w = max(len(r[0]) for r in [*ROWS, *SINGLE])
    print(f"\n{'metric'.ljust(w)}  {'in place':>10}  {'restart':>10}  {'fsdp':>10}  {'etcd':>10}  {'torchrun':>10}  target")
    for field, text, ok in ROWS:
        marks = "/".join("ok" if ok(res.get(p + field)) else "MISSED" for p in ("", "etcd_") if ok is not None and p + field in res)
        print(f"{field.ljust(w)}  {fmt(res.get(field)):>10}  {fmt(res.get('restart_' + field)):>10}  "
              f"{fmt(res.get('fsdp_' + field)):>10}  {fmt(res.get('etcd_' + field)):>10}  "
              f"{fmt(res.get('baseline_' + field)):>10}  {text}{'  ' + marks if marks else ''}")
    for field, text, ok in SINGLE:
        marks = "/".join("ok" if ok(res.get(p + field)) else "MISSED" for p in ("", "etcd_") if p + field in res)
        print(f"{field.ljust(w)}  {fmt(res.get(field)):>10}  {'':>10}  {'':>10}  {fmt(res.get('etcd_' + field)):>10}  "
              f"{'':>10}  {text}{'  ' + marks if marks else ''}")
    if "restart_over_inplace_resume_ratio" in res:
        print(f"restart path / in-place path, notice -> resume: {res['restart_over_inplace_resume_ratio']}x")
    if kinds:  # the unplanned faults side by side (issue 37)
        print(f"\n{'fault (3 nodes, on c)'.ljust(w)}  " + "  ".join(f"{k:>12}" for k in kinds) + "  targets")
        for field, per_kind in FAULTS:
            cells, marks = [], []
            for k in kinds:
                v = fault_value(res, k, field)
                cells.append(f"{fmt(v):>12}")
                text, ok = per_kind[k]
                if ok is not None and v is not None:
                    marks.append(f"{k} {text} {'ok' if ok(v) else 'MISSED'}")
            print(f"{field.ljust(w)}  " + "  ".join(cells) + "  " + "; ".join(marks))
    print(f"targets met: {res['targets_met']}   leftover processes: {res['leftover_processes']}"
          + (f"   work folder kept: {work}" if a.keep else ""))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1, sort_keys=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
