"""Seeded fault injection over localhost agents (benchmark, not a timed test).

One long-lived cluster: an external ``trainguard store``, three ``trainguard run`` agents (one worker
each, ``workers.reform`` left at its default, in-process) training ``examples/train_gpt_elastic.py``
(the end-to-end tests' small model) with async checkpoints to S3 (``moto_server`` behind the
``tests/fixtures/http_faults.py`` fault proxy) and one AWS IMDSv2 emulator per node
(``tests/emulators``). Cases are injected one after another into the running cluster:

* **kinds**: ``drain`` (the ``trainguard drain`` CLI), ``aws_notice`` (a spot
  ``instance-action`` from the node's emulator), ``sigterm_agent`` (all three are planned: notice
  given), ``sigkill_worker``, ``sigkill_agent``, ``sigkill_node`` (agent and workers), ``store_restart``
  (the external store stopped and started again on its port), ``storage_503`` / ``storage_stall`` /
  ``storage_outage`` (the proxy answers uploads with 503, holds them past the client's read timeout,
  or answers every request with 503, for a few seconds), ``metadata_garbage`` / ``metadata_hang`` (the
  node's metadata server answers garbage or hangs); after every case that removed a node, a
  ``scale_up`` case starts a fresh node so the next case starts from three again;
* **phases**: ``step`` (a random moment while training), ``save`` (right after a node staged an
  async checkpoint: the upload is under way), ``rendezvous`` (one node is drained first and a fresh one
  started; the fault hits when the fresh node's round completes, while the world re-forms),
  ``restore`` (a worker is SIGKILLed first; the fault hits while its replacement restores),
  ``allreduce`` (another node's worker is SIGSTOPped for 1.5 s; the fault hits 0.4 s in, while the
  other ranks wait in the step's collectives), ``commit`` (the proxy holds the upload of the next
  ``manifest.json``, rank 0's commit, for 3 s; the fault hits while it is held); the last two are
  numbered after the first 96 fault cases, so windows of the first four phases keep their numbers;
* **targets**: the node whose worker is rank 0, or another one.
* **network kinds** (issue 37; only when ``--only`` names them, phase ``step``, so the seeded matrix
  keeps its numbers): ``partition`` (iptables DROP of everything but ``lo`` inside the target's network
  namespace for ``--partition-s``, then healed) and ``packet_loss`` (``--loss-p``, 5 % by default, of the
  target's incoming packets dropped at random for ``--loss-minutes``: must cause no eviction). They need
  the cluster in network namespaces (``tests/fixtures/netns.py``: each agent in a namespace of its own on
  a bridge, the store in the hub namespace; root, ``ip``, ``iptables``), where the S3 emulator, its fault
  proxy and the metadata emulators (on the machine's 127.0.0.1) are out of reach: such a run checkpoints
  to a ``file://`` folder, its agents watch signals only, and the kinds that need those servers
  (``aws_notice``, ``storage_*``, ``metadata_*``) cannot be mixed in. Figures: a partition's seconds to
  the majority's first step at the smaller world size, the minority's commits after the majority claimed
  its newer epoch (must be 0), the seconds from healing to the first step at the full size again; packet
  loss: evictions (``member_lost``, ``member_evicted``, ``hang_detected``, re-formations, rolled-back
  steps, rendezvous rounds) over the whole loss window, and the step rate with and without loss.
* **dirty failures** (issue 37; only when ``--only`` names them, phase ``step``, like the network kinds):
  ``hang_worker`` (SIGSTOP of the target's worker: its agent names the hang and ends the worker, the node
  rejoins, the others re-form in place; recovery: the first step at the full size after it; the stopped
  worker must not outlive the case), ``freeze_node`` (SIGSTOP of the target's agent and worker: the
  survivors evict it and re-form in place, the recovery; after their epoch claim it is SIGCONTed, must
  commit nothing under an epoch not newer than theirs, and rejoins) and ``late_joiner`` (a short job of
  its own, ``LATE_STEPS`` steps on two nodes beside the cluster, and one more agent started as it ends:
  every agent exits 0, the joiner with state ``succeeded`` or ``not_needed``; its sample log is counted
  from step 1). Each case keeps what the agents logged about it (``dirty_events``).

For every case: recovered (training at the expected world size again, past the step it was at when
the fault hit; for storage faults also a commit after the fault cleared), time to recover, lost steps
(steps trained before the fault that the world trained again), samples skipped / repeated (the sample
log, ``tests/samples.py``), committed checkpoints lost (``scan_run`` before and after; retention is
off), leftover processes (of the cluster before the fault, alive 10 s after recovery and no longer
part of a live node), hang (not recovered within 3x the kind's nominal recovery time). A case that
does not recover restarts the cluster (recorded). Prints a matrix and writes ``--json PATH``.

Run: ``OMP_NUM_THREADS=1 python bench/chaos.py [--quick] [--seed N] [--cases N] [--json out.json] [--keep]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests import samples as sample_log  # noqa: E402
from tests.emulators import AwsImdsEmulator  # noqa: E402
from tests.fixtures.http_faults import HttpFaultProxy  # noqa: E402
from tests.fixtures.netns import HUB_ADDR, Netns  # noqa: E402
from tests.fixtures.netns import unavailable as netns_unavailable  # noqa: E402
from tests.fixtures.storage import make_bucket, s3_options, start_moto_server  # noqa: E402
from tests.harness import RDZV_PROTOCOL, alive, descendants, free_port, memory_root, wait_listening  # noqa: E402

ELASTIC = os.path.join(REPO, "examples", "train_gpt_elastic.py")
GLOBAL_BATCH = 24
JOB_ID = "chaos"
# The end-to-end tests' small model (tests/strategies/_world.py JOB + E2E_SIZE), a step logged each step.
SCRIPT_ARGS = ["--steps", "100000000", "--global-batch", str(GLOBAL_BATCH), "--micro-batch", "4", "--seq-len", "32",
               "--d-model", "32", "--layers", "2", "--max-bytes", "200000", "--log-every", "1", "--lr", "3e-3",
               "--step-sleep", "0.05"]
CKPT_EVERY = 10
LATE_JOB = "chaos-late"
"""``late_joiner``'s job: two nodes beside the cluster (the same store, a rendezvous id of its own, one per
case: :func:`late_job`)."""
LATE_STEPS = 60
LATE_LEAD = 5
"""``late_joiner``: the extra agent starts when the short job logs step ``LATE_STEPS - LATE_LEAD`` (its own
start-up takes seconds: it reaches the store about when the job completes, before or after)."""
STORAGE_FAULT_S = 8.0
LEFTOVER_GRACE_S = 10.0
T0 = time.time()


@dataclass(frozen=True)
class Kind:
    name: str
    planned: bool
    """A notice is given (drain, spot notice, SIGTERM) or the node is added on purpose (scale-up)."""
    removes: bool
    """The target node leaves the world for good."""
    nominal_s: float
    """Nominal recovery time on this 2-core box; 3x this is a hang."""


KINDS = {k.name: k for k in [
    Kind("drain", True, True, 25), Kind("aws_notice", True, True, 25), Kind("sigterm_agent", True, True, 25),
    Kind("sigkill_worker", False, False, 40), Kind("sigkill_agent", False, True, 35),
    Kind("sigkill_node", False, True, 35), Kind("store_restart", False, False, 25),
    Kind("storage_503", False, False, 30), Kind("storage_stall", False, False, 35),
    Kind("storage_outage", False, False, 35), Kind("metadata_garbage", False, False, 20),
    Kind("metadata_hang", False, False, 20), Kind("scale_up", True, False, 60),
    Kind("partition", False, False, 30), Kind("packet_loss", False, False, 30),
    # SIGSTOP of the node's worker: its agent names the hang, SIGKILLs it and restarts it; the node rejoins.
    Kind("hang_worker", False, False, 40),
    # SIGSTOP of agent and worker; the survivors evict it and re-form in place. After that (and the survivors'
    # epoch claim) the bench SIGCONTs it rather than SIGKILLs it: a frozen node does wake up, with a stale
    # world, and what it does then (no commit under an older epoch, rejoin) is the risk being tested, where a
    # SIGKILL would make it a slow sigkill_node. It comes back, so it does not remove a node (`removes`
    # False); the survivors' re-formation at the smaller size is the recovery, the rejoin a figure of its own.
    Kind("freeze_node", False, False, 35),
    # One more agent started as a short job of its own completes (the cluster's job never does): exit 0,
    # state succeeded (it joined in time) or not_needed (the rendezvous was closed). Adds nothing for good.
    Kind("late_joiner", True, False, 60),
]}
NET_KINDS = ["partition", "packet_loss"]
"""Kinds that need the cluster in network namespaces; not in the seeded matrix (``--only`` names them)."""
DIRTY_KINDS = ["hang_worker", "freeze_node", "late_joiner"]
"""Issue 37's dirty failures: only when ``--only`` names them (phase ``step``), so the seeded matrix keeps
its numbers and figures and ``--quick`` its time."""
NAMED_KINDS = NET_KINDS + DIRTY_KINDS
DIRTY_EVENTS = ("hang_detected", "hung_workers_ended", "collectives_abort_requested", "member_lost", "member_evicted",
                "worker_reformed", "left_to_rejoin", "joined_running_world", "job_already_complete", "exit_barrier_done")
"""What the agents log about a dirty failure, kept per case (node: event) for the report."""
NEEDS_LOCALHOST = ["aws_notice", "storage_503", "storage_stall", "storage_outage", "metadata_garbage", "metadata_hang"]
"""Kinds that need the S3 fault proxy or a metadata emulator: servers a namespaced cluster cannot reach."""
FAULTS = [k for k in KINDS if k not in ("scale_up", *NAMED_KINDS)]
NET_PORT = 29400
"""The store's port in the hub namespace (a namespace of this run's own: nothing else listens there)."""
NET_SLOTS = 6
"""Node namespaces a namespaced cluster creates; an agent takes a free one (a restarted cluster reuses them)."""
LOSS_EVICTIONS = ("member_lost", "member_evicted", "hang_detected", "worker_reformed", "step_rolled_back",
                  "collectives_abort_requested", "rendezvous_complete")
"""Events that count as an eviction (or its start) during a ``packet_loss`` case: none may appear."""
PHASES = ["step", "save", "rendezvous", "restore"]
TIMED_PHASES = ["allreduce", "commit"]
"""Phases that need the bench to hold the cluster at a point (cases 97-144 of the full matrix)."""
STALL_S = 1.5
COMMIT_HOLD_S = 3.0
TARGETS = ["rank0", "peer"]
QUICK = [("drain", "step", "peer"), ("sigkill_worker", "step", "peer"), ("sigkill_node", "save", "rank0"),
         ("metadata_garbage", "step", "peer"), ("storage_503", "save", "peer")]


class ChaosError(RuntimeError):
    pass


def script_args(steps: int | None = None) -> list[str]:
    """The job's arguments; ``steps``: a job that ends (``late_joiner``'s), instead of the cluster's endless one."""
    return [str(steps) if steps is not None and i > 0 and SCRIPT_ARGS[i - 1] == "--steps" else a
            for i, a in enumerate(SCRIPT_ARGS)]


def late_job(index: int) -> str:
    """The rendezvous id of case ``index``'s short job: one per case, for the job's end closes its rendezvous
    in the store for good (a second case under the same id found it closed and ended at once)."""
    return f"{LATE_JOB}-{index}"


def samples_dir(work: str, job: str = JOB_ID) -> str:
    return os.path.join(work, "samples" if job == JOB_ID else f"samples-{job}")


def late_outcome(exit_code: int | None, events: list[dict[str, Any]]) -> str | None:
    """How a late joiner ended: ``not_needed`` (the rendezvous was closed: ``job_already_complete``),
    ``succeeded`` (it joined the running world and the job completed with it), None for anything else (a
    non-zero exit, still running, or exit 0 without either line)."""
    if exit_code != 0:
        return None
    if any(e.get("event") == "job_already_complete" for e in events):
        return "not_needed"
    ends = [e for e in events if e.get("event") == "state_change" and e.get("new") == "succeeded"]
    if ends:
        return "not_needed" if ends[-1].get("reason") == "not_needed" else "succeeded"
    return None


def say(text: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {text}", flush=True)


# ---------------------------------------------------------------------------------------- processes
def tree(pid: int) -> set[int]:
    """``pid`` and its live descendants."""
    return {p for p in (pid, *descendants(pid)) if alive(p)}


def cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    return ""


def strays(marker: str) -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != os.getpid()
            and marker in cmdline(int(e)) and alive(int(e))]


def kill_pids(pids: set[int] | list[int], sig: int = signal.SIGKILL) -> None:
    for p in pids:
        with contextlib.suppress(OSError):
            os.kill(p, sig)


class Agent:
    """One node: a ``trainguard run`` agent in a session of its own, its IMDS emulator, and a reader
    thread that parses each output line once (agent events and the worker's ``[default0]:`` lines)."""

    def __init__(self, name: str, work: str, endpoint: str, storage_opts: dict[str, Any], url: str,
                 net: Netns | None = None, slot: str = "", job: str = JOB_ID, steps: int | None = None) -> None:
        """``net``: the agent runs in namespace ``slot`` of ``net`` (its own address for gloo and the
        rendezvous, signals as its only notices: its metadata emulator is out of reach). ``job``/``steps``:
        another job than the cluster's (its own rendezvous id and sample log) that ends after ``steps``
        steps (``late_joiner``); the cluster's job never ends."""
        self.name = name
        self.slot = slot
        self.emu = AwsImdsEmulator()
        self.state_dir = os.path.join(work, f"state-{name}")
        self.socket = os.path.join(self.state_dir, f"{job}.sock")
        net_flags, net_env = net.agent_settings(slot) if net is not None else ([], {"GLOO_SOCKET_IFNAME": "lo"})
        sources = "signal" if net is not None else "aws,signal"
        cmd = [*(net.prefix(slot) if net is not None else []),
               sys.executable, "-m", "trainguard.agent.cli", "run", "--nnodes", "1:3", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--node-name", name,
               "--state-dir", self.state_dir, "--log-dir", os.path.join(work, f"logs-{name}"),
               "--monitor-interval", "0.2", "--set", "agent.log_format=json", "--set", "metrics.port=0",
               "--set", "rendezvous.is_host=false", "--set", "rendezvous.keep_alive_interval_s=1",
               "--set", "rendezvous.keep_alive_max_attempts=3",
               "--set", f"preemption.sources={sources}", "--set", f"preemption.aws_endpoint={self.emu.url}", *net_flags,
               "--set", "preemption.poll_interval_s=0.5",
               # a notice drains when it lands (in the phase the case targets), not the drain lead before its deadline
               "--set", "preemption.train_through_notice=false",
               "--set", f"checkpoint.url={url}", "--set", f"checkpoint.interval_steps={CKPT_EVERY}",
               "--set", "checkpoint.keep_last=100000",
               # tier 0 (on by default) in a folder of this run's own, removed with the work folder
               "--set", f"checkpoint.memory_dir={memory_root(work)}",
               # Every worker the bench SIGKILLs consumes a restart: a budget of 3 would end an agent after
               # its third (the budget working as designed, not a failed recovery).
               "--set", "workers.max_restarts=1000",
               ELASTIC, *script_args(steps), "--sample-log", samples_dir(work, job)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
        if RDZV_PROTOCOL:  # TG_TEST_RDZV_PROTOCOL=keyed: the chaos bench on the other rendezvous protocol
            env["TRAINGUARD_RENDEZVOUS_PROTOCOL"] = RDZV_PROTOCOL
        env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **net_env,
                    "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1",
                    "TRAINGUARD_CHECKPOINT_STORAGE_OPTIONS": json.dumps(storage_opts)})
        self._lock = threading.Lock()
        self.ev: list[tuple[float, dict[str, Any]]] = []
        self.lines: list[str] = []
        self._fh = open(os.path.join(work, f"{name}.log"), "a")
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            t = time.time()
            line = raw.decode(errors="replace").rstrip("\n")
            self._fh.write(line + "\n")
            self._fh.flush()
            text = line.split("]:", 1)[1] if line.startswith("[default") and "]:" in line[:24] else line
            ev = None
            if text.startswith("{"):
                with contextlib.suppress(ValueError):
                    ev = json.loads(text)
            with self._lock:
                self.lines.append(line)
                if isinstance(ev, dict):
                    self.ev.append((t, ev))

    def events(self, name: str, since: float = 0.0) -> list[tuple[float, dict[str, Any]]]:
        with self._lock:
            return [(t, e) for t, e in self.ev if t >= since and e.get("event") == name]

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def workers(self) -> set[int]:
        return tree(self.proc.pid) - {self.proc.pid} if self.running else set()

    def tail(self, n: int = 25) -> list[str]:
        """The last ``n`` JSON event lines (agent and worker; C++ stack frames left out)."""
        with self._lock:
            return [line for line in self.lines if '"event"' in line][-n:]

    def close(self) -> None:
        if self.running:
            kill_pids(tree(self.proc.pid))
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._reader.join(5)
        self._fh.close()
        self.emu.close()


class Store:
    """``trainguard store`` on 127.0.0.1, or (``net``) in the hub namespace on the bridge address."""

    def __init__(self, work: str, port: int | None = None, net: Netns | None = None) -> None:
        self.net = net
        self.host = HUB_ADDR if net is not None else "127.0.0.1"
        self.port = port or (NET_PORT if net is not None else free_port())
        self._log = open(os.path.join(work, "store.log"), "a")
        self.proc = subprocess.Popen([*(net.prefix(None) if net is not None else []), sys.executable, "-m",
                                      "trainguard.agent.cli", "store", "--host", self.host, "--port", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO)
        if net is None:
            wait_listening(self.endpoint, 60)
        elif not wait_for(lambda: net.reachable(None, self.host, self.port), 60):
            raise ChaosError(f"the store in the hub namespace is not listening at {self.endpoint}")

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


# ---------------------------------------------------------------------------------------- results
@dataclass
class CaseResult:
    index: int
    kind: str
    phase: str
    target: str
    planned: bool
    node: str = ""
    world_before: int = 0
    world_expected: int = 0
    recovered: bool = False
    recover_s: float | None = None
    nominal_s: float = 0.0
    hang: bool = False
    lost_steps: int = 0
    step_at_fault: int = 0
    continued_from: int | None = None
    samples_skipped: int = 0
    samples_repeated: int = 0
    sample_errors: list[str] = field(default_factory=list)
    committed_lost: list[str] = field(default_factory=list)
    leftover_pids: list[str] = field(default_factory=list)
    cluster_restarted: bool = False
    majority_resume_s: float | None = None
    """partition, freeze_node: seconds from the fault to the majority's first step at the smaller world size."""
    majority_epoch: int | None = None
    """partition, freeze_node: the checkpoint epoch the majority claimed after the fault."""
    minority_commits: list[str] = field(default_factory=list)
    """partition, freeze_node: commits by the cut-off (frozen) node after the majority claimed its epoch, under
    an epoch not newer than it (before it rejoined): must stay empty."""
    partition_s: float | None = None
    frozen_s: float | None = None
    """freeze_node: seconds from the SIGSTOP to the SIGCONT."""
    rejoin_s: float | None = None
    """partition: seconds from healing (freeze_node: from the SIGCONT) to the first step at the full world
    size again."""
    dirty_events: list[str] = field(default_factory=list)
    """hang_worker, freeze_node, late_joiner: :data:`DIRTY_EVENTS` logged from the fault on (node: event)."""
    late_outcome: str | None = None
    """late_joiner: ``succeeded`` or ``not_needed`` (:func:`late_outcome`); None: neither (a failure)."""
    late_exit_codes: dict[str, int | None] = field(default_factory=dict)
    """late_joiner: every agent of the short job, the joiner last: all must be 0."""
    late_job_steps: int | None = None
    """late_joiner: the last step the short job logged (it must be ``LATE_STEPS``)."""
    loss_p: float | None = None
    loss_s: float | None = None
    dropped_packets: int | None = None
    """packet_loss: packets the statistic rule dropped (counted after GRO: one may be several segments)."""
    evictions: list[str] = field(default_factory=list)
    """packet_loss: :data:`LOSS_EVICTIONS` events during the loss window (node: event): must stay empty."""
    steps_per_s_during: float | None = None
    steps_per_s_after: float | None = None
    """packet_loss: the step rate over the loss window, and over the 30 s after healing (the baseline: the
    window before a case may hold the previous case's recovery)."""
    note: str = ""
    log_excerpt: list[str] = field(default_factory=list)


_STREAM: list[list[int]] = []


def expected_batch(step: int) -> list[int]:
    """The ids step ``step`` (1-based) trains on: the worker API's global sample cursor, as the job
    configures it (its default ``--seed``, the dataset of ``SCRIPT_ARGS``)."""
    if not _STREAM:
        from trainguard.examples.train_gpt import load_corpus
        from trainguard.runtime.cursor import GlobalSampleCursor

        _STREAM.append([])  # placeholder for step 0
        _CURSOR.append(GlobalSampleCursor((len(load_corpus(200_000)) - 1) // 32, GLOBAL_BATCH, seed=1234))
    while len(_STREAM) <= step:
        _STREAM.append([int(i) for i in _CURSOR[0].next_global_batch()])
    return _STREAM[step]


_CURSOR: list[Any] = []


def sample_account(folder: str) -> tuple[int, int, list[str]]:
    """Cumulative (skipped, repeated, errors) over the sample log. Each step must have exactly one
    valid attempt (``tests/samples.py`` ``committed_batches`` asserts it; a rolled-back attempt is
    void) whose ids are the cursor's batch for that step. Skipped: sample slots of steps 1..max with no
    valid attempt, or a batch other than the cursor's; repeated: sample slots of extra valid attempts
    of a step (steps trained again after a restore from an older checkpoint). The run lasts several
    epochs, so an id recurs once per epoch by design: ``check_exactly_once`` (one epoch) does not apply."""
    errors: list[str] = []
    try:
        sample_log.committed_batches(folder)
    except AssertionError as e:
        errors.append(str(e)[:200])
    recs = sample_log.read(folder)
    void = {(r["step"], r["round"]) for r in recs if r.get("rolled_back")}
    attempts: dict[tuple[int, int], list[int]] = {}
    for r in recs:
        if not r.get("rolled_back") and (r["step"], r["round"]) not in void:
            attempts.setdefault((r["step"], r["round"]), r["ids"])
    if not attempts:
        return 0, 0, errors
    per_step = Counter(s for s, _ in attempts)
    skipped = len(set(range(1, max(per_step) + 1)) - set(per_step)) * GLOBAL_BATCH
    wrong = sorted({s for (s, _), ids in attempts.items() if ids != expected_batch(s)})
    skipped += len(wrong) * GLOBAL_BATCH
    if wrong:
        errors.append(f"steps trained on a batch other than the cursor's: {wrong[:10]}")
    repeated = sum(n - 1 for n in per_step.values()) * GLOBAL_BATCH
    return skipped, repeated, errors


class Cluster:
    def __init__(self, work: str, seed: int, netns: bool = False, partition_s: float = 30.0, loss_s: float = 600.0,
                 loss_p: float = 0.05) -> None:
        self.work = work
        self.rng = random.Random(seed)
        os.makedirs(os.path.join(work, "samples"), exist_ok=True)
        self.partition_s, self.loss_s, self.loss_p = partition_s, loss_s, loss_p
        self.net: Netns | None = None
        self.moto = self.proxy = None
        if netns:  # agents in namespaces of their own: S3 and its proxy are out of their reach
            self.net = Netns([f"s{i}" for i in range(NET_SLOTS)])
            self.url = os.path.join(work, "ckpt")
            self.opts = self.scan_opts = {}
        else:
            self.moto = start_moto_server()
            self.proxy = HttpFaultProxy(self.moto.port)
            self.proxy._server.handle_error = lambda *a: None  # a SIGKILLed client's reset connection: expected
            direct = s3_options(self.moto.endpoint)
            os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
            self.url = f"s3://{make_bucket('s3', direct)}/ckpt"
            self.opts = s3_options(self.proxy.endpoint)
            self.scan_opts = direct  # the bench's own scans bypass the faults
        self.store = Store(work, net=self.net)
        self.agents: list[Agent] = []
        self.gone: list[Agent] = []
        self.extras: list[Agent] = []
        self.closed_extras: list[Agent] = []
        """The agents of the last ``late_joiner`` case's short job, closed by it (the report reads their events)."""
        """Agents of another job (``late_joiner``'s), not of the cluster."""
        self.serial = 0
        self.restarts = 0

    # -- membership -------------------------------------------------------------------------------
    def add(self, job: str = JOB_ID, steps: int | None = None) -> Agent:
        """A fresh node of the cluster, or (``job``) of another job, kept in :attr:`extras`."""
        self.serial += 1
        slot = ""
        if self.net is not None:  # a namespace no live agent holds
            taken = {a.slot for a in self.live() + self.extras}
            slot = next(s for s in self.net.names if s not in taken)
            self.net.heal(slot)
        a = Agent(f"n{self.serial}", self.work, self.store.endpoint, self.opts, self.url, self.net, slot, job, steps)
        (self.agents if job == JOB_ID else self.extras).append(a)
        return a

    def live(self) -> list[Agent]:
        for a in list(self.agents):
            if not a.running:
                self.agents.remove(a)
                self.gone.append(a)
        return self.agents

    def steps(self, since: float = 0.0) -> list[tuple[float, dict[str, Any]]]:
        return sorted((te for a in self.agents + self.gone for te in a.events("train_step", since)),
                      key=lambda te: te[0])

    def last_step(self) -> int:
        s = self.steps(time.time() - 30)
        return s[-1][1]["step"] if s else 0

    def rank0(self) -> Agent | None:
        best = None
        for a in self.live():
            s = a.events("train_step", time.time() - 5)
            if s and (best is None or s[-1][0] > best[0]):
                best = (s[-1][0], a)
        return best[1] if best else None

    def training_at(self, world: int, since: float, min_steps: int = 3) -> bool:
        return len([1 for _, e in self.steps(since) if e.get("world_size") == world]) >= min_steps

    def wait_training(self, world: int, timeout: float, what: str) -> None:
        since = time.time()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.live()) >= world and self.training_at(world, since):
                return
            time.sleep(0.2)
        raise ChaosError(f"timed out after {timeout:.0f}s waiting for {what}")

    def committed(self) -> set[tuple[int, int]]:
        from trainguard.checkpoint.discovery import scan_run
        from trainguard.checkpoint.storage import Storage

        for _ in range(3):
            try:
                scan = scan_run(Storage(self.url, self.scan_opts), JOB_ID, warn=False)
                return {(r.step, r.epoch) for r in scan.committed}
            except Exception:  # a listing raced a write: try again
                time.sleep(1)
        return set()

    def pids(self) -> set[int]:
        return {p for a in self.live() for p in tree(a.proc.pid)}

    def restart(self, why: str) -> None:
        """Everything down, a fresh store, three fresh agents (they restore the newest checkpoint)."""
        say(f"cluster restart: {why}")
        self.restarts += 1
        for a in self.agents:
            a.close()
            self.gone.append(a)
        self.agents = []
        kill_pids(set(strays(self.work)) - ({self.moto.proc.pid} if self.moto else set()))
        self.store.stop()
        if self.net is not None:
            for slot in self.net.names:
                self.net.heal(slot)
        self.store = Store(self.work, net=self.net)
        self.start()

    def start(self) -> None:
        for _ in range(3):
            self.add()
            time.sleep(1.0)
        self.wait_training(3, 240, "the first world of 3")

    def close(self) -> None:
        for a in self.agents + self.extras:
            a.close()
        self.store.stop()
        if self.proxy is not None:
            self.proxy.close()
        if self.moto is not None:
            self.moto.stop()
        if self.net is not None:
            self.net.close()


# ---------------------------------------------------------------------------------------- injection
def wait_for(pred: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    return None


def inject(c: Cluster, kind: str, node: Agent) -> float | None:
    """Apply the fault; returns when storage faults clear (epoch seconds), else None."""
    if kind == "drain":  # `trainguard drain` (the bench imports nothing of trainguard.agent)
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run([sys.executable, "-m", "trainguard.agent.cli", "drain", "--socket", node.socket,
                            "--deadline", "30s", "--reason", "chaos"], cwd=REPO, capture_output=True, timeout=30)
    elif kind == "aws_notice":
        node.emu.schedule_termination(in_s=120)
    elif kind == "sigterm_agent":
        node.proc.send_signal(signal.SIGTERM)
    elif kind == "sigkill_worker":
        kill_pids(node.workers())
    elif kind == "sigkill_agent":
        kill_pids([node.proc.pid])
    elif kind == "sigkill_node":
        kill_pids(tree(node.proc.pid))
    elif kind == "store_restart":
        port = c.store.port
        c.store.stop()
        time.sleep(1.0)
        c.store = Store(c.work, port, c.net)
    elif kind.startswith("storage_"):
        if kind == "storage_503":
            c.proxy.fail(r"^(PUT|POST) ", status=503)
        elif kind == "storage_stall":
            c.proxy.stall(r"^(PUT|POST) ", seconds=7.0)
        else:
            c.proxy.fail(r".", status=503)
        threading.Timer(STORAGE_FAULT_S, c.proxy.clear).start()
        return time.time() + STORAGE_FAULT_S
    elif kind == "metadata_garbage":
        node.emu.misbehave("garbage", count=30)
    elif kind == "metadata_hang":
        node.emu.misbehave("hang", count=4, delay_s=6.0)
    elif kind == "hang_worker":
        kill_pids(node.workers(), signal.SIGSTOP)
    elif kind == "freeze_node":
        kill_pids(tree(node.proc.pid), signal.SIGSTOP)
    elif kind == "partition":
        assert c.net is not None
        c.net.partition(node.slot)
    elif kind == "packet_loss":
        assert c.net is not None
        c.net.loss(node.slot, c.loss_p)
    return None


def epoch_claims(nodes: list[Agent], since: float) -> list[tuple[float, int]]:
    """(time, epoch) of every checkpoint epoch ``nodes`` claimed from ``since`` on, oldest first."""
    return sorted((t, e["epoch"]) for a in nodes for t, e in a.events("checkpoint_epoch_claimed", since)
                  if e.get("component") == "trainguard.checkpoint")


def stale_commits(node: Agent, since: float, epoch: int) -> list[str]:
    """``node``'s commits from ``since`` on under an epoch not newer than ``epoch`` (the others' claim)."""
    return [f"step {e['step']} epoch {e['epoch']}" for _, e in node.events("checkpoint_committed", since)
            if e.get("component") == "trainguard.checkpoint" and e["epoch"] <= epoch]


def partition_case(c: Cluster, node: Agent, res: CaseResult, t_fault: float) -> float | None:
    """The cut-off ``node`` (partitioned at ``t_fault``): wait for the majority to train at the smaller size,
    hold the partition ``c.partition_s`` in all, heal, wait for the full size again. Fills the partition
    figures of ``res``; returns when the world trained at its full size again (None: it did not)."""
    assert c.net is not None
    k = KINDS["partition"]
    res.partition_s = c.partition_s
    others = [a for a in c.live() if a is not node]
    smaller = res.world_before - 1

    def first_step(nodes: list[Agent], world: int, since: float, past: int = -1) -> float | None:
        ts = [t for a in nodes for t, e in a.events("train_step", since) if e.get("world_size") == world and e["step"] > past]
        return min(ts) if ts else None

    t_major, t_claim = resume_and_claim(others, smaller, t_fault, -1, res, 3 * k.nominal_s,
                                        ("the majority", "before the heal"))
    time.sleep(max(0.0, t_fault + c.partition_s - time.time()))
    at_heal = c.last_step()
    c.net.heal(node.slot)
    t_heal = time.time()
    say(f"healed {node.name} {t_heal - t_fault:.1f} s after the partition")
    t_back = wait_for(lambda: first_step(c.live(), res.world_before, t_heal, at_heal), 3 * k.nominal_s)
    if t_back is not None:
        res.rejoin_s = round(t_back - t_heal, 2)
    if t_claim is not None:  # the cut-off node's commits under an epoch not newer than the majority's
        res.minority_commits = stale_commits(node, t_claim, res.majority_epoch or 0)
    return t_back if t_major is not None else None


def resume_and_claim(others: list[Agent], smaller: int, t_fault: float, past: int, res: CaseResult, bound_s: float,
                     words: tuple[str, str]) -> tuple[float | None, float | None]:
    """The nodes left after a fault (``others``): when they first trained at world size ``smaller`` past step
    ``past`` (``res.majority_resume_s``; None: not within ``bound_s``) and when they claimed a newer epoch
    (``res.majority_epoch``; None: not within 30 s). ``words``: who they are and when, for the notes."""
    who, when = words
    t_major = wait_for(lambda: min([t for a in others for t, e in a.events("train_step", t_fault)
                                    if e.get("world_size") == smaller and e["step"] > past], default=None), bound_s)
    if t_major is None:
        res.note += f"{who} never trained at world size {smaller}; "
    else:
        res.majority_resume_s = round(t_major - t_fault, 2)
    claims = wait_for(lambda: epoch_claims(others, t_fault), 30)
    if claims:
        res.majority_epoch = claims[0][1]
    else:
        res.note += f"{who} claimed no epoch {when}; "
    return t_major, claims[0][0] if claims else None


def freeze_case(c: Cluster, node: Agent, res: CaseResult, t_fault: float) -> float | None:
    """The frozen ``node`` (SIGSTOPped at ``t_fault``): wait for the survivors' first step at the smaller size
    (the recovery, returned; None: none within 3x nominal) and their epoch claim, SIGCONT the node, wait for
    the full size again and check the woken node committed nothing under an epoch not newer than theirs."""
    k = KINDS["freeze_node"]
    others = [a for a in c.live() if a is not node]
    smaller = res.world_before - 1
    t_major, t_claim = resume_and_claim(others, smaller, t_fault, res.step_at_fault, res, 3 * k.nominal_s,
                                        ("the survivors", "while it was frozen"))
    at_cont = c.last_step()
    kill_pids(tree(node.proc.pid), signal.SIGCONT)
    t_cont = time.time()
    res.frozen_s = round(t_cont - t_fault, 2)
    say(f"SIGCONT {node.name} {res.frozen_s:.1f} s after the freeze")
    t_back = wait_for(lambda: next((t for t, e in c.steps(t_cont) if e.get("world_size") == res.world_before
                                    and e["step"] > at_cont), None), 3 * k.nominal_s)
    if t_back is not None:
        res.rejoin_s = round(t_back - t_cont, 2)
    elif node.running:
        res.hang = True
        res.note += f"{node.name} neither rejoined nor exited within {3 * k.nominal_s:g} s of the SIGCONT; "
    else:
        res.note += f"{node.name} exited {node.proc.returncode} after the SIGCONT instead of rejoining; "
    if t_claim is not None:
        res.minority_commits = stale_commits(node, t_claim, res.majority_epoch or 0)
    return t_major


def start_late_job(c: Cluster, res: CaseResult) -> None:
    """``late_joiner``'s short job: two agents of :func:`late_job` (``LATE_STEPS`` steps), up to step
    ``LATE_STEPS - LATE_LEAD``."""
    os.makedirs(samples_dir(c.work, late_job(res.index)), exist_ok=True)
    for _ in range(2):
        c.add(late_job(res.index), LATE_STEPS)
        time.sleep(1.0)
    res.world_before = res.world_expected = len(c.extras)

    def at() -> int:
        return max((e["step"] for a in c.extras for _, e in a.events("train_step")), default=0)

    if not wait_for(lambda: at() >= LATE_STEPS - LATE_LEAD, 240):
        res.note += f"the short job did not reach step {LATE_STEPS - LATE_LEAD} within 240 s (at {at()}); "


def late_case(c: Cluster, node: Agent, res: CaseResult, t_fault: float) -> float | None:
    """The late ``node`` (started at ``t_fault`` beside the short job): every agent of the short job must
    exit 0, the joiner with state succeeded or not_needed. Returns the joiner's ``agent_exit`` (None: any
    of that not within 3x nominal). Its processes are checked and closed here (they are not the cluster's)."""
    k = KINDS["late_joiner"]
    done = wait_for(lambda: not any(a.running for a in c.extras), 3 * k.nominal_s)
    res.late_exit_codes = {a.name: a.proc.poll() for a in c.extras}
    with node._lock:
        res.late_outcome = late_outcome(node.proc.poll(), [e for _, e in node.ev])
    res.late_job_steps = max((e["step"] for a in c.extras for _, e in a.events("train_step")), default=None)
    if res.late_job_steps != LATE_STEPS:
        res.note += f"the short job's last step was {res.late_job_steps}, not {LATE_STEPS}; "
    exits = node.events("agent_exit")
    t_exit = exits[-1][0] if exits else None
    time.sleep(1.0)
    markers = [samples_dir(c.work, late_job(res.index))] + [a.state_dir for a in c.extras]
    left = sorted({p for m in markers for p in strays(m)})
    res.leftover_pids += [f"{p} {cmdline(p)[:120]}" for p in left]
    kill_pids(left)
    for a in c.extras:
        a.close()
    c.closed_extras, c.extras = c.extras, []
    ok = done and res.late_outcome is not None and all(v == 0 for v in res.late_exit_codes.values())
    return t_exit if ok else None


def loss_case(c: Cluster, node: Agent, res: CaseResult, t_fault: float) -> float | None:
    """``c.loss_p`` of ``node``'s incoming packets dropped from ``t_fault`` for ``c.loss_s``, then healed.
    Fills the loss figures of ``res``; returns the first full-size step after healing when nothing was
    evicted and training went on throughout (None: it did not)."""
    assert c.net is not None
    res.loss_p, res.loss_s = c.loss_p, c.loss_s
    stalled = False
    next_say = time.time() + 60
    while time.time() < t_fault + c.loss_s:
        time.sleep(min(5.0, max(0.0, t_fault + c.loss_s - time.time())))
        if time.time() - t_fault > 30 and not c.steps(time.time() - 30):
            stalled = True
        if time.time() >= next_say:
            next_say += 60
            say(f"packet loss on {node.name}: {time.time() - t_fault:.0f} s, step {c.last_step()}")
    counters = c.net.counters(node.slot)
    c.net.heal(node.slot)
    t_heal = time.time()
    for line in counters.splitlines():
        if "statistic" in line and line.split()[0].isdigit():
            res.dropped_packets = int(line.split()[0])
    during = [e for t, e in c.steps(t_fault) if t <= t_heal]
    res.steps_per_s_during = round(len(during) / max(1e-9, t_heal - t_fault), 2)
    res.evictions = [f"{a.name}: {name}" for a in c.agents + c.gone for name in LOSS_EVICTIONS
                     for t, _ in a.events(name, t_fault) if t <= t_heal]
    at_full = all(e.get("world_size") == res.world_before for e in during)
    if stalled:
        res.note += "no step for 30 s during the loss; "
    if not at_full:
        res.note += f"world sizes during the loss: {sorted({e.get('world_size') for e in during})}; "
    t_next = wait_for(lambda: next((t for t, e in c.steps(t_heal) if e.get("world_size") == res.world_before), None), 60)
    time.sleep(max(0.0, t_heal + 30 - time.time()))
    after = [e for t, e in c.steps(t_heal) if t <= t_heal + 30 and e.get("world_size") == res.world_before]
    res.steps_per_s_after = round(len(after) / 30.0, 2)
    return t_next if (during and at_full and not stalled and not res.evictions) else None


def pick(c: Cluster, target: str, pool: list[Agent] | None = None) -> Agent:
    pool = pool or c.live()
    r0 = c.rank0()
    if target == "rank0" and r0 in pool:
        return r0
    others = [a for a in pool if a is not r0] or pool
    return c.rng.choice(others)


def prepare_phase(c: Cluster, phase: str, target: str, res: CaseResult) -> Agent:
    """Bring the cluster to the phase; return the node to hit."""
    if phase == "step":
        time.sleep(c.rng.uniform(0.0, 1.5))
        return pick(c, target)
    if phase == "save":
        node = pick(c, target)
        since = time.time()
        hit = wait_for(lambda: any(a.events("checkpoint_staged", since) for a in c.live()), 60)
        if not hit:
            res.note += "no save seen within 60 s; "
        return node
    if phase == "allreduce":  # stop one other node's worker: everyone else waits for it in a collective
        node = pick(c, target)
        others = [a for a in c.live() if a is not node]
        staller = c.rng.choice(others) if others else node
        stopped = staller.workers()
        kill_pids(stopped, signal.SIGSTOP)
        threading.Timer(STALL_S, kill_pids, args=(stopped, signal.SIGCONT)).start()
        time.sleep(0.4)
        res.note += f"worker of {staller.name} stopped {STALL_S:g} s; "
        return node
    if phase == "commit":  # hold rank 0's next commit (the manifest upload) and hit while it is held
        node = pick(c, target)
        rule = c.proxy.stall(r"^(PUT|POST) \S*manifest\.json", seconds=COMMIT_HOLD_S, times=1)
        if not wait_for(lambda: rule.hits > 0, 60):
            res.note += "no commit seen within 60 s; "
            c.proxy.clear()
        time.sleep(0.3)
        return node
    if phase == "restore":
        victim = c.rng.choice(c.live())
        old = victim.workers()
        kill_pids(old)
        new = wait_for(lambda: victim.workers() - old, 60)
        if not new:
            res.note += "no replacement worker seen; "
        time.sleep(0.5)
        res.note += f"worker of {victim.name} SIGKILLed first; "
        return pick(c, target)
    # rendezvous: make room (a planned drain), start a fresh node, hit when its round completes
    leaver = pick(c, "peer")
    inject(c, "drain", leaver)
    c.wait_training(2, 90, "world 2 before the rendezvous phase")
    fresh = c.add()
    since = time.time()
    done = wait_for(lambda: fresh.events("rendezvous_complete", since), 120)
    if not done:
        res.note += "the fresh node's round never completed; "
    res.note += f"{leaver.name} drained, {fresh.name} joining; "
    return pick(c, target, c.live())


def run_case(c: Cluster, index: int, kind: str, phase: str, target: str) -> CaseResult:
    k = KINDS[kind]
    res = CaseResult(index=index, kind=kind, phase=phase, target=target, planned=k.planned, nominal_s=k.nominal_s)
    before_committed = c.committed()
    skipped0, repeated0, errors0 = sample_account(os.path.join(c.work, "samples"))
    if kind == "scale_up":
        res.world_before = len(c.live())
        pids_before = c.pids()
        t_fault = time.time()
        res.step_at_fault = c.last_step()
        node = c.add()
        clears_at = None
    elif kind == "late_joiner":  # the cluster trains on; a short job of its own beside it, then the joiner
        start_late_job(c, res)
        pids_before = c.pids()
        res.step_at_fault = c.last_step()
        t_fault = time.time()
        node = c.add(late_job(index), LATE_STEPS)
        clears_at = None
    else:
        node = prepare_phase(c, phase, target, res)
        res.world_before = len(c.live())
        pids_before = c.pids()
        res.step_at_fault = c.last_step()
        stopped = node.workers() if kind == "hang_worker" else set()
        t_fault = time.time()
        clears_at = inject(c, kind, node)
        if kind == "drain":  # the clock starts when the CLI (a Python start-up) has handed the request over
            t_fault = time.time()
    res.node = node.name
    if kind != "late_joiner":
        res.world_expected = res.world_before + (1 if kind == "scale_up" else 0) - (1 if k.removes else 0)
    say(f"case {index}: {kind} @ {phase} on {node.name} ({target}), world {res.world_before} -> {res.world_expected}")

    def recovered() -> float | None:
        steps = [(t, e) for t, e in c.steps(t_fault) if e.get("world_size") == res.world_expected]
        if len([1 for _, e in steps if e["step"] > res.step_at_fault]) < 3:
            return None
        if k.removes and node.running:
            return None
        if kind == "store_restart":  # the agents must be talking to the restarted store again
            now = time.time()
            if now - t_fault < 5 or any(a.events("rendezvous_poll_failed", now - 3) for a in c.live()):
                return None
        if clears_at is not None:
            commits = [t for a in c.agents + c.gone for t, _ in a.events("checkpoint_committed", clears_at)]
            if not commits:
                return None
        # the first step at the expected world after the last disruption seen since the fault
        disrupt = [t for a in c.agents + c.gone for name in ("rendezvous_complete", "step_rolled_back", "worker_reformed")
                   for t, _ in a.events(name, t_fault)]
        after = max(disrupt, default=t_fault)
        t_step = next((t for t, e in steps if t >= after), None)
        if t_step is None:
            return None
        return max(t_step, max(commits) if clears_at is not None else 0.0)

    custom = {"partition": partition_case, "packet_loss": loss_case, "freeze_node": freeze_case,
              "late_joiner": late_case}
    if kind in custom:
        t_rec = custom[kind](c, node, res, t_fault)
        res.hang = res.hang or t_rec is None
    else:
        hang_at = time.monotonic() + 3 * k.nominal_s
        t_rec = None
        while time.monotonic() < hang_at and t_rec is None:
            t_rec = recovered()
            if t_rec is None:
                time.sleep(0.25)
        if t_rec is None:
            res.hang = True
            t_rec = wait_for(recovered, 30)
    if t_rec is not None:
        res.recovered = True
        res.recover_s = round(t_rec - t_fault, 2)
    # what the world continued from: the first resumed/reformed event after the fault
    cont = sorted((t, e["step"]) for a in c.agents + c.gone for name in ("resumed", "reformed")
                  for t, e in a.events(name, t_fault) if isinstance(e.get("step"), int))
    if cont:  # lost: steps trained (logged) before the world continued from an earlier one
        t_cont, res.continued_from = cont[0]
        trained = max([e["step"] for _, e in c.steps(t_fault - 30) if _ < t_cont] + [res.step_at_fault])
        res.lost_steps = max(0, trained - res.continued_from)
    elif res.recovered:
        steps = [e["step"] for _, e in c.steps(t_fault)]
        res.continued_from = (min(steps) - 1) if steps else None
        res.lost_steps = max(0, res.step_at_fault - res.continued_from) if res.continued_from is not None else 0
    # leftovers: processes of the cluster before the fault that belong to no live node now
    time.sleep(0.5)
    wait_for(lambda: not ((pids_before - c.pids()) & {p for p in pids_before if alive(p)}), LEFTOVER_GRACE_S)
    if kind == "hang_worker":  # the stopped worker must be gone (its agent ends it), not left behind
        left_stopped = sorted(p for p in stopped if alive(p))
        if left_stopped:
            res.note += f"the stopped worker(s) {left_stopped} still alive after the case: SIGKILLed; "
            res.leftover_pids += [f"{p} {cmdline(p)[:120]} (stopped)" for p in left_stopped]
            kill_pids(left_stopped)
    left = {p for p in pids_before if alive(p)} - c.pids()
    res.leftover_pids += [f"{p} {cmdline(p)[:120]}" for p in sorted(left)]
    if kind in DIRTY_KINDS:
        nodes = dict.fromkeys(c.agents + c.gone + [node] + (c.closed_extras if kind == "late_joiner" else []))
        res.dirty_events = [f"{a.name}: {name}" for t, a, name in sorted(
            ((t, a, name) for a in nodes for name in DIRTY_EVENTS for t, _ in a.events(name, t_fault)),
            key=lambda x: x[0])]
    after_committed = c.committed()
    res.committed_lost = [f"step {s} epoch {e}" for s, e in sorted(before_committed - after_committed)]
    skipped1, repeated1, errors1 = sample_account(os.path.join(c.work, "samples"))
    res.samples_skipped, res.samples_repeated = skipped1 - skipped0, repeated1 - repeated0
    res.sample_errors = [e for e in errors1 if e not in errors0]
    if kind == "late_joiner":  # the short job's own log, from its step 1
        skipped, repeated, errors = sample_account(samples_dir(c.work, late_job(index)))
        res.samples_skipped += skipped
        res.samples_repeated += repeated
        res.sample_errors += [f"{late_job(index)}: {e}" for e in errors]
    if (not res.recovered or res.hang or res.committed_lost or res.minority_commits or res.evictions
            or res.leftover_pids
            or (k.planned and (res.samples_skipped or res.samples_repeated))):
        res.log_excerpt = [f"{a.name}: {line}" for a in c.live() + [node] for line in a.tail(12)]
    if not res.recovered and kind != "late_joiner":  # the short job is not the cluster: nothing to restart
        c.restart(f"case {index} ({kind} @ {phase}) did not recover")
        res.cluster_restarted = True
    return res


def plan(seed: int, quick: bool, cap: int | None, skip: int = 0, only: str | None = None) -> list[tuple[str, str, str]]:
    """The fault cases: ``--quick``'s list, or every kind x phase x target in a seeded order, from
    ``skip`` on (so runs with the same seed and disjoint ``--skip``/``--cases`` windows add up to the
    full matrix), narrowed to ``only`` (see :func:`select`). The kinds of :data:`NAMED_KINDS` (network and
    dirty failures, phase ``step``) follow, each target once (``late_joiner``: once, no target), only where
    ``only`` names them: the matrix keeps its numbers."""
    if quick:
        return list(QUICK)
    rng = random.Random(seed)
    cases = [(k, p, t) for k in FAULTS for p in PHASES for t in TARGETS]
    rng.shuffle(cases)
    timed = [(k, p, t) for k in FAULTS for p in TIMED_PHASES for t in TARGETS]
    random.Random(seed + 1).shuffle(timed)
    cases = [c for c in (cases + timed)[skip:] if select(c, only)]
    named = {pat.strip().partition("@")[0] for pat in (only or "").split(",")}
    cases += [(k, "step", t) for k in NAMED_KINDS if k in named for t in (["-"] if k == "late_joiner" else TARGETS)
              if select((k, "step", t), only)]
    return cases[:cap] if cap else cases


def needs_netns(cases: list[tuple[str, str, str]]) -> bool:
    """Whether ``cases`` need the cluster in network namespaces; SystemExit when they also need a server
    only the machine's own namespace has (the S3 fault proxy, a metadata emulator)."""
    if not any(k in NET_KINDS for k, _, _ in cases):
        return False
    clash = sorted({f"{k}@{p}" for k, p, _ in cases if k in NEEDS_LOCALHOST or p == "commit"})
    if clash:
        raise SystemExit(f"chaos: {NET_KINDS} run the agents in network namespaces, where the S3 fault proxy and "
                         f"the metadata emulators are out of reach; run {clash} in another invocation")
    return True


def select(case: tuple[str, str, str], only: str | None) -> bool:
    """``--only``: comma-separated ``kind@phase`` patterns, either side may be ``*`` or ``planned``
    (the kinds that give notice), e.g. ``planned@restore`` or ``drain@*,sigkill_node@commit``."""
    if not only:
        return True
    kind, phase, _ = case
    for pat in only.split(","):
        k, _, ph = pat.strip().partition("@")
        if k not in ("*", "planned", "") and k not in KINDS or ph not in ("*", "") and ph not in PHASES + TIMED_PHASES:
            raise SystemExit(f"chaos: --only {pat!r}: expected kind@phase with kind in {sorted(KINDS)} + "
                             f"['*', 'planned'] and phase in {PHASES + TIMED_PHASES} + ['*']")
        if (k in ("*", "") or k == kind or k == "planned" and KINDS[kind].planned) and ph in ("*", "", phase):
            return True
    return False


def row(r: CaseResult) -> str:
    rec = "yes" if r.recovered else "NO"
    t = f"{r.recover_s:.1f}" if r.recover_s is not None else "-"
    out = (f"{r.index:>3} {r.kind:<17} {r.phase:<10} {r.target:<5} {r.node:<4} {r.world_before}->{r.world_expected} "
           f"{rec:<4} {t:>6} {r.lost_steps:>4} {r.samples_skipped:>5} {r.samples_repeated:>5} "
           f"{len(r.committed_lost):>5} {len(r.leftover_pids):>5} {'HANG' if r.hang else '-':<4}")
    if r.kind == "partition":
        out += (f"\n    partition {r.partition_s:g} s: majority at {r.world_before - 1} after {r.majority_resume_s} s "
                f"(epoch {r.majority_epoch}), minority commits after it {len(r.minority_commits)}, "
                f"full size {r.rejoin_s} s after healing")
    elif r.kind == "freeze_node":
        out += (f"\n    frozen {r.frozen_s} s: survivors at {r.world_before - 1} after {r.majority_resume_s} s "
                f"(epoch {r.majority_epoch}), its commits after it {len(r.minority_commits)}, "
                f"full size {r.rejoin_s} s after SIGCONT")
    elif r.kind == "late_joiner":
        out += (f"\n    short job of {LATE_STEPS} steps (last logged {r.late_job_steps}): joiner {r.late_outcome}, "
                f"exit codes {r.late_exit_codes}")
    elif r.kind == "packet_loss":
        out += (f"\n    {100 * (r.loss_p or 0):g} % loss for {r.loss_s:g} s: {len(r.evictions)} evictions, "
                f"{r.dropped_packets} packets dropped, {r.steps_per_s_during} steps/s during, {r.steps_per_s_after} after")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0, help="order of the cases, targets and timings")
    p.add_argument("--quick", action="store_true", help="the CI subset (5 faults + their scale-ups)")
    p.add_argument("--cases", type=int, default=None, help="run at most N fault cases (scale-ups not counted)")
    p.add_argument("--skip", type=int, default=0, help="start at this index of the seeded order (chunked full runs)")
    p.add_argument("--only", default=None, help="only these cases of the seeded order: kind@phase[,...] "
                                                 "(either side * ; kind 'planned': the kinds that give notice)")
    p.add_argument("--repeat", type=int, default=1, help="run the selected cases this many times over")
    p.add_argument("--budget-s", type=float, default=None, help="start no new fault case after this many seconds")
    p.add_argument("--partition-s", type=float, default=30.0, help="partition: how long the node stays cut off")
    p.add_argument("--loss-minutes", type=float, default=10.0, help="packet_loss: how long the loss lasts")
    p.add_argument("--loss-p", type=float, default=0.05, help="packet_loss: share of the node's incoming packets dropped")
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--keep", action="store_true", help="keep the work folder (logs, sample log)")
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cases = plan(a.seed, a.quick, a.cases, a.skip, a.only) * max(1, a.repeat)
    netns = needs_netns(cases)
    if netns and (why := netns_unavailable()):
        raise SystemExit(f"chaos: {NET_KINDS} need network namespaces: {why}")
    work = tempfile.mkdtemp(prefix="tg-chaos-")

    def stop(signum: int, _frame: Any) -> None:  # a SIGTERM (timeout, CI) still cleans up every process
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    say(f"work folder {work}; {len(cases)} fault cases, seed {a.seed}{', agents in network namespaces' if netns else ''}")
    results: list[CaseResult] = []
    c: Cluster | None = None
    t_start = time.time()
    error = None
    done = 0
    try:
        c = Cluster(work, a.seed, netns, a.partition_s, 60 * a.loss_minutes, a.loss_p)
        c.start()
        for kind, phase, target in cases:
            if a.budget_s is not None and time.time() - t_start > a.budget_s:
                say(f"--budget-s {a.budget_s:g} spent: {len(cases) - done} fault cases not run")
                break
            done += 1
            r = run_case(c, len(results) + 1, kind, phase, target)
            results.append(r)
            print(row(r), flush=True)
            while len(c.live()) < 3:  # scale back up so the next case starts from 3 nodes
                r = run_case(c, len(results) + 1, "scale_up", f"after_{kind}", "-")
                results.append(r)
                print(row(r), flush=True)
    except (ChaosError, KeyboardInterrupt) as e:
        error = f"{type(e).__name__}: {e}"
        say(f"aborted: {e}")
    finally:
        if c is not None:
            c.close()
        leftover_end = strays(work)
        kill_pids(set(leftover_end))
    hdr = (f"{'#':>3} {'kind':<17} {'phase':<10} {'tgt':<5} {'node':<4} world {'rec':<4} {'rec_s':>6} {'lost':>4} "
           f"{'skip':>5} {'rep':>5} {'ckpt-':>5} {'left':>5} hang")
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for r in results:
        print(row(r))
    faults = [r for r in results if r.kind != "scale_up"]
    summary = {
        "cases": len(results), "fault_cases": len(faults), "scale_up_cases": len(results) - len(faults),
        "recovered": sum(r.recovered for r in results), "hangs": sum(r.hang for r in results),
        "committed_lost": sum(len(r.committed_lost) for r in results),
        "planned_samples_skipped": sum(r.samples_skipped for r in results if r.planned),
        "planned_samples_repeated": sum(r.samples_repeated for r in results if r.planned),
        "samples_skipped": sum(r.samples_skipped for r in results),
        "samples_repeated": sum(r.samples_repeated for r in results),
        "leftover_processes": sum(len(r.leftover_pids) for r in results) + len(leftover_end),
        "leftover_at_end": len(leftover_end), "cluster_restarts": c.restarts if c else 0,
        "median_recover_s": _median([r.recover_s for r in results if r.recover_s is not None]),
        "wall_s": round(time.time() - t_start, 1), "seed": a.seed, "skip": a.skip, "only": a.only, "planned_fault_cases": len(cases), "quick": a.quick, "error": error,
    }
    dirty = [r for r in results if r.kind in DIRTY_KINDS]
    if dirty:
        freezes = [r for r in dirty if r.kind == "freeze_node"]
        lates = [r for r in dirty if r.kind == "late_joiner"]
        summary.update({
            "hang_worker_recover_s": [r.recover_s for r in dirty if r.kind == "hang_worker"],
            "freeze_survivors_resume_s": [r.majority_resume_s for r in freezes],
            "freeze_rejoin_s": [r.rejoin_s for r in freezes],
            "freeze_stale_commits": sum(len(r.minority_commits) for r in freezes),
            "late_joiner_outcomes": [r.late_outcome for r in lates],
        })
    if netns:
        parts = [r for r in results if r.kind == "partition"]
        losses = [r for r in results if r.kind == "packet_loss"]
        summary.update({
            "netns": True, "partition_s": a.partition_s,
            "partition_majority_resume_s": [r.majority_resume_s for r in parts],
            "partition_rejoin_s": [r.rejoin_s for r in parts],
            "partition_minority_commits": sum(len(r.minority_commits) for r in parts),
            "loss_p": a.loss_p, "loss_minutes": a.loss_minutes,
            "packet_loss_evictions": sum(len(r.evictions) for r in losses),
            "packet_loss_dropped_packets": [r.dropped_packets for r in losses],
        })
    print("\n" + json.dumps(summary))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"summary": summary, "cases": [asdict(r) for r in results]}, fh, indent=1)
    shutil.rmtree(memory_root(work), ignore_errors=True)  # SIGKILLed agents leave their tier-0 folders
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        say(f"kept {work}")
    return 0 if error is None else 1


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


if __name__ == "__main__":
    sys.exit(main())
