"""trainguard and its peers side by side: one tiny job, the same faults, the same harness (issue 39).

The job (``bench/peers_jobs/``: a 2-layer MLP on synthetic data, global batch 24, AdamW) is written once
per peer's API: ``torchrun_job.py`` (plain DDP + ``torch.save`` every ``--ckpt-every`` steps),
``trainguard_job.py`` (the worker API; ``checkpoint.interval`` = ``--ckpt-every``), ``torchft_job.py``
(Manager + its DDP and optimizer wrapper; heals from live peers), ``nvrx_job.py`` (the torchrun job plus
nvidia-resiliency-ext heartbeats, under ``ft_launcher``), and the torchrun job under DLRover's ``dlrover-run``
(``dlrover_launch.py``: a wrapper for torch 2.13, with its job master beside the nodes), and ``ray_job.py``
(Ray Train's ``TorchTrainer`` with ``FailureConfig``, a ``ray.train`` checkpoint every ``--ckpt-every`` steps; each
node a raylet of its own on loopback, node a also the driver and the head; a failure restarts the whole worker
group). Local "nodes" of one worker each (gloo, CPU, ``OMP_NUM_THREADS=1``) on 127.0.0.1: nodes a and b start
(``--nnodes 1:3`` where the peer has it; node a hosts the rendezvous), train ``--warm`` steps at world
size 2, then one fault hits node b from outside:

* ``kill_worker``: SIGKILL to b's training process.
* ``kill_node``: SIGKILL to b's launcher and everything under it (process groups too: torch elastic starts
  workers in sessions of their own). Ray: b's launcher is its ``ray start --block``, so the raylet and its
  workers go (the GCS on node a learns it from its node health check).
* ``hang``: SIGSTOP to b's training process (a hung worker: sockets stay open; Ray's renamed worker
  process is found by the pid its step lines carry).
* ``freeze``: SIGSTOP to b's launcher and its workers (a frozen node).
* ``notice``: a planned notice. trainguard: SIGTERM to b's agent, its signal notice path
  (``preemption.sources=signal``, ``train_through_notice=false`` so the drain starts at the notice);
  the peers: SIGTERM to b's launcher, which is what a spot reclaim gives them (Ray: its ``ray start --block``,
  which drains the node with reason preemption, up to 30 s, before it stops the node's processes).
* ``join``: a third node c starts (the clock starts with its launcher).

Per peer x fault (every figure from the workers' own one-line-per-step log, ``common.log_step``):
``recover_s`` seconds from the fault to the first finished step of the re-formed world (a step of a
(process, generation) pair not seen before the fault, or at another world size; for ``join`` at world
size 3), or ``null`` with ``recovered: false`` when none came within ``--recover-wait`` s;
``lost_steps`` (last step finished before the re-formation minus the step it resumed from);
``world_after``; for ``join`` also ``join_pause_s`` (the world's pause: its last step at world size 2 to its first at 3) and
``join_startup_s`` (the rest: the new node's start-up until the world paused for it);
``skipped`` / ``repeated`` samples against the job's own stream up to its last step
(the global batch of every step rank 0 finished; trainguard: every attempt in its sample log that it did
not roll back); ``completed`` (the job reached ``--steps``); trainguard's
``every_step_once`` (``tests/samples.py`` ``check_stream``: each step up to the last one logged committed once,
with the ids the job's cursor deals it, so each id once per epoch; ``in_flight_at_end``: steps a rank had begun
when the harness ended a job that outran ``--finish-wait``). Per peer,
``step_s`` is the median step interval at world size 2 before the fault, and ``overhead_pct`` that
against plain torchrun's.

Peers are optional (``pip install 'trainguard[peers]'``); a peer that is not importable, or whose run
cannot start, gets rows saying why. ``--reps N`` runs the whole matrix N times (repetition by repetition, so that a load
that drifts spreads over every peer alike); the table and the JSON's ``summary`` give per (peer, fault) the
median ``recover_s`` of the runs that recovered, its min-max spread and how many did, and the worst run's
lost / skipped / repeated; ``cells`` keeps every run. ``--baseline PYTHON`` adds a row ``trainguard@base`` whose
nodes run on another checkout's interpreter (its venv, its editable install): a change and the code before it
side by side, under the same load. Run: ``OMP_NUM_THREADS=1 python bench/peers.py
[--json PATH] [--png PATH] [--reps N] [--peers torchrun,trainguard,...] [--faults kill_node,...]``. Several minutes per peer,
mostly the bounded waits of faults a peer does not recover from.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.join(BENCH, "peers_jobs"))
import common  # noqa: E402  (the job's shared part: data, batches)
import recovery  # noqa: E402  (the launcher process wrapper, fault helpers and sweeps of bench/recovery.py)
from recovery import REPO, BenchError, Proc, kill_tree, say, strays, wait_until  # noqa: E402

from tests.harness import alive, descendants, free_port, memory_root  # noqa: E402

JOBS = os.path.join(BENCH, "peers_jobs")
FAULTS = ("kill_worker", "kill_node", "hang", "freeze", "notice", "join")
MONITOR_INTERVAL = recovery.MONITOR_INTERVAL


# ---------------------------------------------------------------------------------------- peers
@dataclass
class Peer:
    """One peer (and settings variant): how a node's launcher is started and what a notice is."""

    key: str
    """Row label, e.g. ``torchft-fast``."""
    script: str
    settings: str = "defaults"
    """What the variant changes, in words (the table's last column)."""
    module: str | None = None
    """The import that tells whether the peer is installed."""
    env: dict[str, str] = field(default_factory=dict)

    def missing(self) -> str | None:
        if self.module and importlib.util.find_spec(self.module) is None:
            return f"not installed (import {self.module} failed; pip install 'trainguard[peers]')"
        return None

    @contextlib.contextmanager
    def cluster(self, d: str, a: argparse.Namespace) -> Any:
        """What the job needs beside its nodes, for one run (torchft: the lighthouse)."""
        yield {"endpoint": f"127.0.0.1:{free_port()}"}

    def node(self, name: str, idx: int, d: str, c: dict[str, Any], a: argparse.Namespace) -> Proc:
        raise NotImplementedError

    def job_args(self, d: str, a: argparse.Namespace) -> list[str]:
        return [os.path.join(JOBS, self.script), "--steps", str(a.steps), "--step-sleep", str(a.step_sleep),
                "--ckpt-every", str(a.ckpt_every), "--step-log", os.path.join(d, "steps")]

    def used(self, d: str, evs: list[dict[str, Any]]) -> Counter[int]:
        """How often each sample id was trained: the global batch of every step that rank 0 finished (a
        finished step went through its collective on every rank, but a killed rank may not have logged it;
        these jobs derive the batch from the step number, so a redone step repeats its samples)."""
        return Counter(i for e in evs if e["rank"] == 0 for i in common.global_batch(e["step"]))

    def notice(self, node: Proc) -> None:
        node.proc.send_signal(signal.SIGTERM)

    def worker(self, node: Proc, d: str) -> int | None:
        """The node's live training process (the target of ``kill_worker`` and ``hang``)."""
        return job_pid(node, os.path.join(JOBS, self.script))

    def expected(self, max_step: int) -> list[int]:
        return [i for s in range(1, max_step + 1) for i in common.global_batch(s)]


def _torchrun(ep: str, rdzv_id: str, is_host: bool, nnodes: str = "1:3") -> list[str]:
    """A node's ``torchrun`` command up to the script (ft_launcher takes the same flags)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", ep, "--rdzv-id", rdzv_id,
            "--rdzv-conf", f"is_host={int(is_host)}", "--max-restarts", "5", "--local-addr", "127.0.0.1",
            "--monitor-interval", str(MONITOR_INTERVAL)]


class TorchrunPeer(Peer):
    """Plain ``torchrun`` elastic (c10d, as installed): a failure restarts every worker from the last
    ``torch.save`` checkpoint."""

    def node(self, name: str, idx: int, d: str, c: dict[str, Any], a: argparse.Namespace) -> Proc:
        cmd = [*_torchrun(c["endpoint"], "peers", idx == 0), *self.job_args(d, a),
               "--ckpt-dir", os.path.join(d, "ckpt")]
        return Proc(f"{self.key}-{name}", cmd, os.path.join(d, f"{name}.log"), self.env)


class TrainguardPeer(Peer):
    """``trainguard run`` agents (c10d hosted by node a, worker API, in-place re-formation)."""

    def __init__(self, key: str, settings: str, options: tuple[str, ...] = (), python: str = "") -> None:
        super().__init__(key, "trainguard_job.py", settings, "trainguard.runtime")
        self.options = options
        """``--set key=value`` pairs beside the defaults (the fast row)."""
        self.python = python or sys.executable
        """The interpreter of the agents (and so of their workers): ``--baseline`` gives another checkout's."""

    def missing(self) -> str | None:
        if self.python != sys.executable:
            return None if os.access(self.python, os.X_OK) else f"--baseline {self.python}: not an executable"
        return super().missing()

    def node(self, name: str, idx: int, d: str, c: dict[str, Any], a: argparse.Namespace) -> Proc:
        samples = os.path.join(d, "samples")
        os.makedirs(samples, exist_ok=True)
        cmd = [self.python, "-m", "trainguard.agent.cli", "run", "--nnodes", "1:3", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", c["endpoint"], "--rdzv-id", "peers",
               "--node-name", name, "--local-addr", "127.0.0.1", "--monitor-interval", str(MONITOR_INTERVAL),
               "--state-dir", os.path.join(d, f"state-{name}"), "--log-dir", os.path.join(d, f"logs-{name}"),
               "--set", "agent.log_format=json", "--set", "metrics.port=0",
               "--set", f"checkpoint.memory_dir={memory_root(d)}",
               "--set", f"checkpoint.url={os.path.join(d, 'ckpt')}", "--set", f"checkpoint.interval={a.ckpt_every}",
               "--set", "preemption.sources=signal", "--set", "preemption.train_through_notice=false",
               "--set", f"rendezvous.is_host={'true' if idx == 0 else 'false'}",
               *[x for o in self.options for x in ("--set", o)],
               *self.job_args(d, a), "--sample-log", samples]
        return Proc(f"{self.key}-{name}", cmd, os.path.join(d, f"{name}.log"), self.env)

    def used(self, d: str, evs: list[dict[str, Any]]) -> Counter[int]:
        """From the sample log: a rank that drains exits inside the agreed step's ``end_step``, before its
        step line; every attempt (step, round) not rolled back counts once with its whole global batch, up to
        the last step logged (``evs``), as the other peers' step lines count: an attempt after it was in flight
        when the harness ended a job that outran ``--finish-wait`` (``in_flight_at_end``), never committed."""
        from tests import samples

        last = max((e["step"] for e in evs), default=0)
        recs = samples.read(os.path.join(d, "samples"))
        void = {(r["step"], r["round"]) for r in recs if r.get("rolled_back")}
        attempts = {(r["step"], r["round"]): r["ids"] for r in recs
                    if not r.get("rolled_back") and (r["step"], r["round"]) not in void and r["step"] <= last}
        return Counter(i for ids in attempts.values() for i in ids)

    def expected(self, max_step: int) -> list[int]:
        return [i for ids in self.stream(max_step) for i in ids]

    @staticmethod
    def stream(max_step: int) -> list[list[int]]:
        """The global batch of each step 1..``max_step`` as the job's cursor deals them (epoch after epoch)."""
        from trainguard.runtime.cursor import GlobalSampleCursor

        cur = GlobalSampleCursor(common.N_SAMPLES, common.GLOBAL_BATCH, seed=common.SEED)
        return [cur.next_global_batch() for _ in range(max_step)]


class TorchftPeer(Peer):
    """torchft: one replica group per node, each under its own single-node ``torchrun`` (restarts its
    worker, which heals from a live replica); the lighthouse (``torchft_lighthouse``) runs beside them."""

    def __init__(self, key: str, settings: str, lighthouse: list[str], env: dict[str, str]) -> None:
        super().__init__(key, "torchft_job.py", settings, "torchft", env)
        self.lighthouse = lighthouse

    def missing(self) -> str | None:
        return super().missing() or (None if shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable))
                                     or shutil.which("torchft_lighthouse") else "torchft_lighthouse not on PATH")

    @contextlib.contextmanager
    def cluster(self, d: str, a: argparse.Namespace) -> Any:
        port = free_port()
        exe = shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable)) or "torchft_lighthouse"
        lh = Proc(f"{self.key}-lighthouse", [exe, "--min_replicas", "1", "--bind", f"127.0.0.1:{port}", *self.lighthouse],
                  os.path.join(d, "lighthouse.log"))
        try:
            yield {"lighthouse": f"http://127.0.0.1:{port}", "procs": [lh]}
        finally:
            lh.kill()

    def node(self, name: str, idx: int, d: str, c: dict[str, Any], a: argparse.Namespace) -> Proc:
        cmd = [*_torchrun(f"127.0.0.1:{free_port()}", f"peers-{name}", True, nnodes="1"), *self.job_args(d, a)]
        env = {**self.env, "TORCHFT_LIGHTHOUSE": c["lighthouse"], "REPLICA_GROUP_ID": str(idx)}
        return Proc(f"{self.key}-{name}", cmd, os.path.join(d, f"{name}.log"), env)


class NvrxPeer(Peer):
    """nvidia-resiliency-ext's ``ft_launcher`` (torchrun's flags plus ``--ft-*``; heartbeats from the job,
    a failure restarts the whole group, which restores the last ``torch.save`` checkpoint)."""

    wheel_dir: str = ""
    """An unpacked wheel (``--nvrx-wheel-dir``): 0.7.0 ships manylinux_2_39 cp312/cp314 wheels only; its
    launcher is pure Python and runs on Python 3.11 from the unpacked folder (its dependencies installed)."""

    def __init__(self, key: str, settings: str, ft: list[str]) -> None:
        super().__init__(key, "nvrx_job.py", settings, "nvidia_resiliency_ext")
        self.ft = ft

    def missing(self) -> str | None:
        if self.wheel_dir and os.path.isdir(os.path.join(self.wheel_dir, "nvidia_resiliency_ext")):
            return None
        if super().missing():
            return ("not installed: nvidia-resiliency-ext 0.7.0 ships only manylinux_2_39 cp312/cp314 wheels (no pip "
                    "install on glibc < 2.39 or Python 3.11); unpack one and pass --nvrx-wheel-dir (docs/benchmarks.md)")
        return None

    def node(self, name: str, idx: int, d: str, c: dict[str, Any], a: argparse.Namespace) -> Proc:
        # --nnodes 2:3, not 1:3: its barrier rendezvous completes a round with the first node at once and does
        # not grow a running world, so with a minimum of 1 node a and b would train as two worlds of 1.
        cmd = [*_torchrun(c["endpoint"], "peers", idx == 0, nnodes="2:3"), *self.ft, *self.job_args(d, a),
               "--ckpt-dir", os.path.join(d, "ckpt")]
        cmd[1:3] = ["-m", "nvidia_resiliency_ext.fault_tolerance.launcher"]
        # One launcher per host address: its rendezvous closes on two participants from one address.
        cmd[cmd.index("--local-addr") + 1] = f"127.0.0.{idx + 1}"
        env = {**self.env, "PYTHONPATH": os.pathsep.join(p for p in (self.wheel_dir, os.environ.get("PYTHONPATH")) if p)}
        return Proc(f"{self.key}-{name}", cmd, os.path.join(d, f"{name}.log"), env)


class DlroverPeer(Peer):
    """DLRover's ``dlrover-run`` (its own ElasticTrainingAgent over torch elastic) with the plain torchrun job,
    one launcher per node and its job master (``dlrover.python.master.main --platform local``) beside them,
    as a multi-node job gets it; ``peers_jobs/dlrover_launch.py`` passes torch 2.13's ``numa_options``."""

    def __init__(self, key: str, settings: str, extra: tuple[str, ...] = ()) -> None:
        super().__init__(key, "torchrun_job.py", settings, "dlrover.trainer.torch.elastic_run")
        self.extra = extra
        """``dlrover-run`` flags beside the defaults (the fast row)."""

    @contextlib.contextmanager
    def cluster(self, d: str, a: argparse.Namespace) -> Any:
        port = free_port()
        master = Proc(f"{self.key}-master", [sys.executable, "-u", "-m", "dlrover.python.master.main", "--port", str(port),
                                             "--node_num", "2", "--job_name", "peers", "--platform", "local"],
                      os.path.join(d, "master.log"))
        try:
            yield {"master": f"127.0.0.1:{port}", "procs": [master]}
        finally:
            master.kill()

    def node(self, name: str, idx: int, d: str, c: dict[str, Any], a: argparse.Namespace) -> Proc:
        cmd = [sys.executable, os.path.join(JOBS, "dlrover_launch.py"), "--nnodes", "1:3", "--nproc_per_node", "1",
               "--max_restarts", "5", "--monitor_interval", str(MONITOR_INTERVAL), *self.extra, *self.job_args(d, a),
               "--ckpt-dir", os.path.join(d, "ckpt")]
        env = {**self.env, "DLROVER_MASTER_ADDR": c["master"], "NODE_ID": str(idx), "NODE_RANK": str(idx),
               "NODE_NUM": "2", "JOB_NAME": "peers", "POD_IP": "127.0.0.1"}
        return Proc(f"{self.key}-{name}", cmd, os.path.join(d, f"{name}.log"), env)


class RayPeer(Peer):
    """Ray Train 2.60 (``TorchTrainer``, its V2 API) on a local Ray cluster of real raylets on loopback: node a
    is the driver, which starts the head raylet (GCS included) as its child; nodes b and c are ``ray start
    --address ... --block`` raylets of their own (``peers_jobs/ray_job.py``), one CPU each, one worker each.
    A failure restarts the whole worker group from the last ``ray.train`` checkpoint (``FailureConfig``)."""

    def __init__(self, key: str, settings: str, workers: str, env: dict[str, str], resize_every: float = 60.0) -> None:
        super().__init__(key, "ray_job.py", settings, "ray.train.torch", env)
        self.workers = workers
        """``ScalingConfig(num_workers)``: ``2`` fixed, or ``MIN:MAX`` for Ray's elastic training."""
        self.resize_every = resize_every

    @contextlib.contextmanager
    def cluster(self, d: str, a: argparse.Namespace) -> Any:
        # Short and fresh per run: Ray keeps its sockets under it (a unix socket path is limited to 107
        # bytes) and its "current cluster" file, so no run finds another's cluster.
        tmp = tempfile.mkdtemp(prefix="tgray-", dir="/tmp")
        try:
            yield {"address": f"127.0.0.1:{free_port()}", "temp_dir": tmp}
        finally:
            if a.keep:  # Ray Train's controller and worker logs (its restart decisions, with times)
                with contextlib.suppress(OSError):
                    shutil.copytree(os.path.join(tmp, "session_latest", "logs"), os.path.join(d, "ray-logs"),
                                    ignore=shutil.ignore_patterns("*.sock"), dirs_exist_ok=True)
            # Ray renames its processes (``ray::DashboardAgent``) and some outlive their raylet's tree kill:
            # every process of this run's nodes carries the marker in its environment.
            for pid in {*strays(tmp), *self.marked(tmp)}:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def marked(tmp: str) -> list[int]:
        """Live processes whose environment holds ``TG_BENCH_RAY=<tmp>`` (set on each node's launcher)."""
        mark = f"TG_BENCH_RAY={tmp}".encode()
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                with contextlib.suppress(OSError), open(f"/proc/{entry}/environ", "rb") as fh:
                    if mark in fh.read().split(b"\0") and alive(int(entry)):
                        out.append(int(entry))
        return out

    def node(self, name: str, idx: int, d: str, c: dict[str, Any], a: argparse.Namespace) -> Proc:
        cmd = [sys.executable, os.path.join(JOBS, "ray_job.py"), "--role", "head" if idx == 0 else "node",
               "--address", c["address"], "--temp-dir", c["temp_dir"], "--workers", self.workers,
               "--resize-every", str(self.resize_every), *self.job_args(d, a)[1:]]
        # Ray's workers are forked by the raylet and inherit its environment: they import common from here.
        env = {**self.env, "PYTHONPATH": os.pathsep.join(p for p in (JOBS, os.environ.get("PYTHONPATH")) if p),
               "RAY_USAGE_STATS_ENABLED": "0", "TG_BENCH_RAY": c["temp_dir"]}
        return Proc(f"{self.key}-{name}", cmd, os.path.join(d, f"{name}.log"), env)

    def worker(self, node: Proc, d: str) -> int | None:
        """Ray renames its worker processes (``ray::RayTrainWorker...``): the node's training process is the
        raylet's descendant that has written step lines (``common.log_step`` records its pid)."""
        logged = {e["pid"] for _, e in steps(d)}
        return next((p for p in descendants(node.proc.pid) if p in logged and alive(p)), None)


def peers() -> list[Peer]:
    return [
        TorchrunPeer("torchrun", "torchrun_job.py", "torchrun 2.13 as installed, c10d, max-restarts 5"),
        TrainguardPeer("trainguard", "defaults, in-place re-formation"),
        TrainguardPeer("trainguard-fast", "heartbeats every 0.1 s, probes answered within 0.15 s, a stopped worker named "
                       "after 0.15 s, a silent rank or node after 1 s, keep-alive 1 s x 3",
                       ("hang.heartbeat_interval_s=0.1", "hang.stale_beats=2", "hang.silent_s=1", "hang.frozen_s=1",
                        "hang.probe_timeout_s=0.15", "hang.stopped_s=0.15", "hang.proc_poll_s=0.05",
                        "rendezvous.keep_alive_interval_s=1", "rendezvous.keep_alive_max_attempts=3")),
        TorchftPeer("torchft", "quickstart lighthouse (--quorum_tick_ms 100 --join_timeout_ms 10000), heartbeat 5 s",
                    ["--quorum_tick_ms", "100", "--join_timeout_ms", "10000"], {}),
        TorchftPeer("torchft-fast", "heartbeat timeout 1 s, op timeout 5 s",
                    ["--quorum_tick_ms", "100", "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "1000"],
                    {"TORCHFT_TIMEOUT_SEC": "5", "TORCHFT_QUORUM_TIMEOUT_SEC": "5"}),
        DlroverPeer("dlrover", "dlrover-run 0.6.1 defaults (its master waits lastcall_timeout 60 s for max nodes), "
                               "job master --platform local, torch.save every K steps"),
        DlroverPeer("dlrover-fast", "--rdzv-conf lastcall_timeout=1 (its docs' knob: wait 1 s for more nodes)",
                    ("--rdzv-conf", "lastcall_timeout=1")),
        NvrxPeer("nvrx", "ft_launcher 0.7.0 defaults (heartbeat timeouts unset)", []),
        NvrxPeer("nvrx-fast", "rank heartbeat timeout 5 s, checked every 1 s",
                 ["--ft-initial-rank-heartbeat-timeout", "60", "--ft-rank-heartbeat-timeout", "5",
                  "--ft-workload-check-interval", "1"]),
        RayPeer("ray-train", "Ray Train 2.60 defaults: num_workers=2 fixed, FailureConfig(max_failures=5), worker "
                             "health check timeout 600 s, GCS node health check 3 s x 5", "2", {}),
        RayPeer("ray-train-fast", "elastic num_workers=(1, 3), resize checked every 5 s; worker health check timeout "
                                  "5 s, polled every 1 s; GCS node health check 1 s x 3",
                "1:3", {"RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S": "5", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "1",
                        "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
                        "RAY_health_check_timeout_ms": "1000"}, resize_every=5.0),
    ]


NOT_RUN: dict[str, str] = {}
"""Peers of the issue this harness does not run yet, with why (each becomes a row of its own)."""


# ---------------------------------------------------------------------------------------- one run
def steps(d: str) -> list[tuple[float, dict[str, Any]]]:
    """Every worker's step line of the run in ``d`` (``common.log_step``), ordered by the worker's clock."""
    out = []
    for path in glob.glob(os.path.join(d, "steps", "*.jsonl")):
        with open(path) as fh:
            for line in fh:
                with contextlib.suppress(ValueError):  # a line cut by a SIGKILL
                    e = json.loads(line)
                    out.append((e["t"], e))
    return sorted(out, key=lambda te: te[0])


def program_of(args: list[str]) -> str | None:
    """The script a Python command line (arguments after the interpreter) runs: its first non-option
    argument, or, for trainguard's prestarted interpreter (``-m trainguard.runtime.warm FD -- SCRIPT``),
    the first after its ``--``."""
    if "trainguard.runtime.warm" in args and "--" in args:
        args = args[args.index("--") + 1:]
    return next((x for x in args if not x.startswith("-")), None)


def job_pid(node: Proc, script: str) -> int | None:
    """The node's live training process: ``python [-u] <script> ...`` (not a helper the launcher forked,
    such as ft_launcher's rank monitor, whose command line names the script only as an argument)."""
    for pid in descendants(node.proc.pid):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as fh:
            args = [x.decode(errors="replace") for x in fh.read().split(b"\0")[1:]]
            if program_of(args) == script and alive(pid):
                return pid
    return None


def tree(node: Proc) -> list[int]:
    return [node.proc.pid, *descendants(node.proc.pid)]


def inject(peer: Peer, fault: str, nb: Proc, d: str) -> list[int]:
    """Apply ``fault`` to node b; returns the pids it stopped (SIGCONT'd at the end)."""
    if fault in ("kill_worker", "hang"):
        pid = wait_until(lambda: peer.worker(nb, d), 10, "node b's training process")
        os.kill(pid, signal.SIGKILL if fault == "kill_worker" else signal.SIGSTOP)
        return [pid] if fault == "hang" else []
    if fault == "kill_node":
        kill_tree(nb.proc.pid)
        return []
    if fault == "freeze":
        pids = tree(nb)
        kill_tree(nb.proc.pid, signal.SIGSTOP)
        return pids
    if fault == "notice":
        peer.notice(nb)
        return []
    raise ValueError(fault)


def step_time(evs: list[tuple[float, dict[str, Any]]]) -> float | None:
    """Median interval between consecutive steps of one worker at world size 2 (its first 3 skipped)."""
    by_pid: dict[int, list[float]] = {}
    for t, e in evs:
        if e["world"] == 2:
            by_pid.setdefault(e["pid"], []).append(t)
    gaps = [b - a for ts in by_pid.values() for a, b in zip(ts[3:], ts[4:])]
    return statistics.median(gaps) if gaps else None


def run_cell(peer: Peer, fault: str, work: str, a: argparse.Namespace, rep: int = 0) -> dict[str, Any]:
    d = os.path.join(work, peer.key, fault, f"rep-{rep}")
    os.makedirs(d)
    res: dict[str, Any] = {"peer": peer.key, "fault": fault, "rep": rep, "recovered": False}
    nodes: list[Proc] = []
    stopped: list[int] = []
    evs: list[tuple[float, dict[str, Any]]] = []
    try:
        with peer.cluster(d, a) as c:
            nodes.append(peer.node("a", 0, d, c, a))
            time.sleep(0.5)
            nodes.append(peer.node("b", 1, d, c, a))
            wait_until(lambda: len({e["step"] for _, e in steps(d) if e["world"] == 2}) >= a.warm,
                       a.start_wait, f"{a.warm} steps at world size 2", procs=[*nodes, *c.get("procs", [])])
            before = steps(d)
            res["step_s"] = step_time(before)
            if fault == "join":
                nodes.append(peer.node("c", 2, d, c, a))
                t_fault = nodes[-1].started
                live = list(nodes)
            else:
                t_fault = time.time()
                stopped = inject(peer, fault, nodes[1], d)
                live = [nodes[0]]  # node b's launcher may also live on (or come back): its end is not waited for
            say("bench", f"{peer.key}: {fault} on node {'c' if fault == 'join' else 'b'}")
            before = [(t, e) for t, e in steps(d) if t <= t_fault]
            old = {(e["pid"], e["gen"]) for _, e in before}
            world_before = before[-1][1]["world"]
            res["fault_at_step"] = max(e["step"] for _, e in before)
            if res["fault_at_step"] >= a.steps:
                raise BenchError(f"the job finished ({a.steps} steps) before the fault: raise --steps")

            def reformed() -> tuple[float, dict[str, Any]] | None:
                for t, e in steps(d):
                    if t > t_fault and ((e["pid"], e["gen"]) not in old or e["world"] != world_before):
                        if fault != "join" or e["world"] == 3:
                            return t, e
                return None

            try:
                t_rec, ev = wait_until(reformed, a.recover_wait, "the first step of the re-formed world",
                                       interval=0.1)
            except BenchError:
                res["note"] = f"not recovered within {a.recover_wait:.0f} s"
                if max(e["step"] for _, e in steps(d)) >= a.steps:  # not a verdict on the peer: the run was short
                    res["note"] = f"the job's {a.steps} steps ended first: raise --steps"
                say("bench", f"{peer.key}: {fault}: {res['note']}")
            else:
                old_steps = [e["step"] for t, e in steps(d) if (e["pid"], e["gen"]) in old]
                res.update(recovered=True, recover_s=round(t_rec - t_fault, 3), world_after=ev["world"],
                           resumed_from=ev["step"] - 1, lost_steps=max(0, max(old_steps) - (ev["step"] - 1)))
                if fault == "join":  # the world's pause: its last step at the old size to the first at 3
                    last2 = max((t for t, e in steps(d) if e["world"] == world_before and t < t_rec), default=None)
                    if last2 is not None:
                        res["join_pause_s"] = round(t_rec - last2, 3)
                        res["join_startup_s"] = round(max(0.0, last2 - t_fault), 3)
                say("bench", f"{peer.key}: {fault}: step {ev['step']} at world size {ev['world']} "
                             f"{res['recover_s']:.2f} s after the fault")
                with contextlib.suppress(BenchError):  # the job's end (every live launcher exits)
                    wait_until(lambda: all(n.proc.poll() is not None for n in live),
                               a.finish_wait, f"the job's {a.steps} steps", interval=0.2)
            evs = steps(d)
            res["exit_codes"] = {n.name: n.proc.poll() for n in nodes}
    finally:
        for pid in stopped:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        for n in nodes:
            n.kill()
        for pid in strays(d):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(memory_root(d), ignore_errors=True)
    finished = sorted({e["step"] for _, e in evs})
    res["last_step"] = finished[-1] if finished else 0
    res["completed"] = res["last_step"] >= a.steps
    used = peer.used(d, [e for _, e in evs])
    expected = Counter(peer.expected(res["last_step"]))
    res.update(skipped=sum((expected - used).values()), repeated=sum((used - expected).values()))
    if isinstance(peer, TrainguardPeer):
        from tests import samples

        stream = TrainguardPeer.stream(res["last_step"])
        try:  # the stream's own order, epoch after epoch (a long run wraps: --steps over 341 is a second epoch)
            cut = samples.check_stream(os.path.join(d, "samples"), lambda step: stream[step - 1], upto=res["last_step"])
            res["every_step_once"] = True
            if cut:  # steps in flight when the harness ended the job (its finish wait ran out): never committed
                res["in_flight_at_end"] = cut
        except AssertionError as e:
            res["every_step_once"] = False
            res["every_step_once_error"] = str(e)[:300]
    return res


# ---------------------------------------------------------------------------------------- report
def summarize(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pure: one row per (peer, fault) over its repetitions, in the order first seen. ``recover_s`` the
    median of the runs that recovered (``recover_min_s`` / ``recover_max_s`` their spread), ``recovered``
    how many of ``runs`` did; ``lost_steps``, ``skipped``, ``repeated`` the worst run's; ``world_after``
    the worlds seen; ``completed`` how many runs finished the job; ``notes`` each distinct note or error."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault((c["peer"], c["fault"]), []).append(c)
    out = []
    for (peer, fault), cs in groups.items():
        rec = sorted(c["recover_s"] for c in cs if c.get("recovered") and c.get("recover_s") is not None)

        def worst(key: str) -> int | None:
            vals = [c[key] for c in cs if c.get(key) is not None]
            return max(vals) if vals else None

        notes = []
        for c in cs:
            n = c.get("note") or c.get("error")
            if n and n not in notes:
                notes.append(n)
        pauses = sorted(c["join_pause_s"] for c in cs if c.get("join_pause_s") is not None)
        extra = {"join_pause_s": round(statistics.median(pauses), 3)} if pauses else {}
        out.append({**extra, "peer": peer, "fault": fault, "runs": len(cs), "recovered": len(rec),
                    "recover_s": round(statistics.median(rec), 3) if rec else None,
                    "recover_min_s": rec[0] if rec else None, "recover_max_s": rec[-1] if rec else None,
                    "lost_steps": worst("lost_steps"), "skipped": worst("skipped"), "repeated": worst("repeated"),
                    "world_after": sorted({c["world_after"] for c in cs if c.get("world_after") is not None}),
                    "completed": sum(bool(c.get("completed")) for c in cs), "notes": notes})
    return out


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def table(res: dict[str, Any]) -> str:
    """The matrix: one row per (peer, fault), the median of its repetitions with their spread and how many
    recovered (``never`` when none did); lost / skip / rep the worst run's; ``done`` runs that finished."""
    out = [f"{'peer':<14} {'fault':<12} {'recover_s':>9} {'spread':>13} {'rec':>5} {'lost':>5} {'world':>6} "
           f"{'skip':>5} {'rep':>5} {'done':>5}  note"]
    for row in res.get("summary") or summarize(res["cells"]):
        n = row["runs"]
        rec = fmt(float(row["recover_s"])) if row["recovered"] else "never"
        spread = (f"{row['recover_min_s']:.2f}-{row['recover_max_s']:.2f}" if row["recovered"] > 1 else "-")
        world = ",".join(str(w) for w in row["world_after"]) or "-"
        out.append(f"{row['peer']:<14} {row['fault']:<12} {rec:>9} {spread:>13} {row['recovered']:>3}/{n:<1} "
                   f"{fmt(row['lost_steps']):>5} {world:>6} {fmt(row['skipped']):>5} {fmt(row['repeated']):>5} "
                   f"{row['completed']:>3}/{n:<1}  {'; '.join(row['notes'])}")
    for row in res.get("summary") or summarize(res["cells"]):
        if row.get("join_pause_s") is not None and row["recover_s"] is not None:
            out.append(f"{row['peer']} join: the world paused {row['join_pause_s']:.2f} s (its last step at 2 to its "
                       f"first at 3) of {row['recover_s']:.2f} s; the rest is the new node's start-up (medians)")
    out.append("")
    out.append(f"{'peer':<14} {'step_s':>8} {'overhead':>9}  settings")
    for key, p in res["peers"].items():
        over = p.get("overhead_pct")
        out.append(f"{key:<14} {fmt(p.get('step_s')):>8} {(f'{over:+.1f}%' if over is not None else '-'):>9}  "
                   f"{p.get('settings') or p.get('not_run', '')}")
    return "\n".join(out)


def plot(res: dict[str, Any], path: str) -> str | None:
    """A bar chart of ``recover_s`` per fault and peer (never-recovered bars at the bounded wait, hatched)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed"
    keys = [k for k, p in res["peers"].items() if "not_run" not in p]
    faults = res["faults"]
    rows = {(r["peer"], r["fault"]): r for r in res.get("summary") or summarize(res["cells"])}
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / max(1, len(keys))
    for i, k in enumerate(keys):
        for j, f in enumerate(faults):
            row = rows.get((k, f))
            if row is None:
                continue
            x = j + i * width
            if row["recovered"]:
                v = row["recover_s"]
                ax.bar(x, v, width, color=f"C{i}", label=k if j == 0 else None)
                if row["recovered"] > 1:
                    ax.errorbar(x, v, yerr=[[v - row["recover_min_s"]], [row["recover_max_s"] - v]], color="black",
                                capsize=2, linewidth=0.8)
            else:
                ax.bar(x, res["recover_wait_s"], width, color=f"C{i}", hatch="//", alpha=0.4,
                       label=k if j == 0 else None)
    ax.set_xticks([j + width * (len(keys) - 1) / 2 for j in range(len(faults))], faults)
    ax.set_yscale("log")
    ax.set_ylabel("fault -> next step (s, log); median, min-max; hatched: never")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    ap.add_argument("--png", default=None, metavar="PATH", help="draw recover_s per fault and peer (matplotlib)")
    ap.add_argument("--peers", default=None, help="comma-separated peer keys (default: every installed one)")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {','.join(FAULTS)}")
    ap.add_argument("--steps", type=int, default=300, help="the job's total steps")
    ap.add_argument("--warm", type=int, default=30, help="steps at world size 2 before the fault")
    ap.add_argument("--ckpt-every", type=int, default=10, help="checkpoint interval (steps) where the peer has one")
    ap.add_argument("--step-sleep", type=float, default=0.05, help="per-step sleep of the job (s)")
    ap.add_argument("--recover-wait", type=float, default=120.0, help="bounded wait for a re-formed world (s)")
    ap.add_argument("--start-wait", type=float, default=180.0, help="bounded wait for the first steps at world size 2 (s)")
    ap.add_argument("--finish-wait", type=float, default=120.0, help="bounded wait for the job's end after recovery (s)")
    ap.add_argument("--nvrx-wheel-dir", default="", metavar="DIR",
                    help="an unpacked nvidia-resiliency-ext wheel (no wheel for this glibc/Python installs; see docs/benchmarks.md)")
    ap.add_argument("--reps", type=int, default=1, help="repetitions of every cell (the table gives medians and spread)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs, checkpoints)")
    ap.add_argument("--baseline", default="", metavar="PYTHON",
                    help="add a row trainguard@base (defaults) whose agents and workers run on this interpreter: another "
                         "checkout's venv, for a before/after under the same load in one run")
    a = ap.parse_args(argv)
    faults = [f.strip() for f in a.faults.split(",") if f.strip()]
    if not faults or any(f not in FAULTS for f in faults):
        ap.error(f"--faults: choose from {','.join(FAULTS)}; got {a.faults!r}")
    if a.reps < 1:
        ap.error(f"--reps: at least 1, got {a.reps}")
    NvrxPeer.wheel_dir = os.path.abspath(a.nvrx_wheel_dir) if a.nvrx_wheel_dir else ""
    known = peers()
    if a.baseline:
        known.insert(1, TrainguardPeer("trainguard@base", f"defaults, on {a.baseline} (its checkout's code)",
                                       python=os.path.abspath(a.baseline) if os.sep in a.baseline else a.baseline))
    wanted = [k.strip() for k in a.peers.split(",")] if a.peers else [p.key for p in known]
    if a.baseline and "trainguard@base" not in wanted:
        wanted.insert(0, "trainguard@base")
    unknown = set(wanted) - {p.key for p in known} - set(NOT_RUN)
    if unknown:
        ap.error(f"--peers: unknown {sorted(unknown)}; choose from {[p.key for p in known] + list(NOT_RUN)}")

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    work = tempfile.mkdtemp(prefix="tg-bench-peers-")
    load = os.getloadavg()
    res: dict[str, Any] = {"faults": faults, "reps": a.reps, "steps": a.steps, "warm": a.warm, "ckpt_every": a.ckpt_every,
                           "step_sleep_s": a.step_sleep, "recover_wait_s": a.recover_wait,
                           "global_batch": common.GLOBAL_BATCH, "nodes": "2 (+1 joining), 1 worker each, gloo, CPU",
                           "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cpus": os.cpu_count(),
                           "loadavg_start": [round(x, 2) for x in load], "peers": {}, "cells": []}
    print(f"peers benchmark: work folder {work}; load average {load[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    try:
        runnable = []
        for p in known:
            if p.key not in wanted:
                continue
            why = p.missing()
            res["peers"][p.key] = {"settings": p.settings}
            if why:
                res["peers"][p.key]["not_run"] = why
            else:
                runnable.append(p)
        # Repetition by repetition over the whole matrix: a load that drifts over the run spreads over
        # every peer alike instead of landing on one.
        for rep in range(a.reps):
            for p in runnable:
                for f in faults:
                    try:
                        res["cells"].append(run_cell(p, f, work, a, rep))
                    except Exception as e:  # one cell failing must not lose the others' figures
                        res["cells"].append({"peer": p.key, "fault": f, "rep": rep, "recovered": False,
                                             "error": f"{type(e).__name__}: {e}"})
                        say("bench", f"{p.key}: {f} FAILED: {e}")
                    if a.json:  # after every cell: a long run stopped half-way keeps what it measured
                        with open(a.json, "w") as fh:
                            json.dump({**res, "partial": True}, fh, indent=1, sort_keys=True)
        for key, why in NOT_RUN.items():
            if a.peers is None or key in wanted:
                res["peers"][key] = {"not_run": why}
    finally:
        for pid in strays(work):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    for key, p in res["peers"].items():
        times = [c["step_s"] for c in res["cells"] if c["peer"] == key and c.get("step_s")]
        p["step_s"] = round(statistics.median(times), 4) if times else None
    base = res["peers"].get("torchrun", {}).get("step_s")
    for p in res["peers"].values():
        if base and p.get("step_s"):
            p["overhead_pct"] = round(100 * (p["step_s"] / base - 1), 1)
    res["summary"] = summarize(res["cells"])
    res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print()
    print(table(res))
    print(f"load average {res['loadavg_start'][0]:.2f} at the start, {res['loadavg_end'][0]:.2f} at the end "
          f"({os.cpu_count()} CPUs); step_s: median step interval at world size 2 before the fault")
    if a.png:
        why = plot(res, a.png)
        if why:
            print(f"no PNG: {why}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1, sort_keys=True)
    return 1 if any("error" in c for c in res["cells"]) else 0


if __name__ == "__main__":
    sys.exit(main())
