"""trainguard under a real Slurm (``tests/fixtures/slurm.py``: munged + slurmctld + two slurmd here).

Each job is ``srun`` of one ``trainguard run`` per node with *no* job id, node name, node count or
endpoint flags: the agents take them from Slurm's environment (:mod:`trainguard.agent.slurm`) and
meet at the first host of ``SLURM_JOB_NODELIST``. The notices are Slurm's own: ``scancel
--signal=USR1`` (what ``#SBATCH --signal=USR1@s`` sends at the time limit), and preemption by a job
of a higher-priority partition (SIGTERM, ``GraceTime``, ``PreemptMode=REQUEUE``) after which the
requeued job - the same job id - resumes from its emergency checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fixtures.slurm import GRACE_S, SlurmCluster, slurm_cluster  # noqa: F401
from trainguard.agent.slurm import expand_hostlist
from tests.harness import REPO, json_events, memory_root, short_tmp, wait_until  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
ELASTIC = os.path.join(REPO, "examples", "train_gpt_elastic.py")
REQUEUE_SCRIPT = os.path.join(REPO, "examples", "slurm", "requeue.sbatch")
ELASTIC_SCRIPT = os.path.join(REPO, "examples", "slurm", "elastic.sbatch")
FIXED_SCRIPT = os.path.join(REPO, "examples", "slurm", "fixed.sbatch")
"""The examples under test: the jobs here are submitted with them, as the docs tell users to."""
BIN = os.path.dirname(sys.executable)
"""Where ``trainguard`` is installed (the batch scripts call it)."""


def _events(path: str, name: str | None = None) -> list[dict[str, Any]]:
    """JSON events of one agent's log file (none before it exists)."""
    try:
        with open(path, errors="replace") as fh:
            return json_events(fh.read().splitlines(), name)
    except FileNotFoundError:
        return []


class Job:
    """One job of two agents submitted with ``examples/slurm/requeue.sbatch`` (the script's ``#SBATCH``
    lines ask for 4 nodes; ``-N2`` on the command line wins); each agent appends to ``<tmp>/agent-<node>.log``
    (a requeued run too)."""

    def __init__(self, cluster: SlurmCluster, tmp: str, *sbatch_args: str, script: str = "",
                 flags: str = "") -> None:
        self.cluster, self.tmp = cluster, tmp
        self.logs = {n: os.path.join(tmp, f"agent-{n}.log") for n in cluster.nodes}
        agent = (f"exec {sys.executable} -m trainguard.agent.cli run --nproc-per-node 1 {flags} "
                 f"--state-dir {tmp}/state-$SLURMD_NODENAME --log-dir {tmp}/logs-$SLURMD_NODENAME "
                 "--monitor-interval 0.2 --set agent.log_format=json --set preemption.sources=signal "
                 f"--set metrics.port=0 --set checkpoint.url={tmp}/ckpt --set checkpoint.interval_steps=15 "
                 f"{ELASTIC} --steps 100000 --log-every 5 --step-sleep 0.05 --global-batch 24 "
                 f">> {tmp}/agent-$SLURMD_NODENAME.log 2>&1")
        self.id = cluster.sbatch("-N2", "-D", REPO, "-o", f"{tmp}/job-%j.out",
                                 f"--export=ALL,OMP_NUM_THREADS=1,PYTHONUNBUFFERED=1,PATH={BIN}:{os.environ['PATH']},"
                                 f"TRAINGUARD_CHECKPOINT_MEMORY_DIR={memory_root(tmp)}", *sbatch_args,
                                 script or REQUEUE_SCRIPT, "bash", "-c", agent)

    def cancel(self) -> None:
        """End the job whatever state it is in, so that the next test gets both nodes."""
        self.cluster.cmd("scancel", self.id, check=False)
        wait_until(lambda: self.state() not in ("RUNNING", "COMPLETING", "CONFIGURING"), 120, f"job {self.id} ended")

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        return [e for path in self.logs.values() for e in _events(path, name)]

    def steps_at(self, world: int) -> list[int]:
        return [e["step"] for e in self.events("train_step") if e.get("world_size") == world]

    def state(self) -> str:
        return self.cluster.job_field(self.id, "JobState")

    def dump(self) -> str:
        out = [f"--- job {self.id}: {self.state()} {self.cluster.job_field(self.id, 'Command')}"]
        try:
            with open(os.path.join(self.tmp, f"job-{self.id}.out"), errors="replace") as fh:
                out.append(fh.read()[-3000:])
        except FileNotFoundError:
            pass
        for node, path in self.logs.items():
            try:
                with open(path, errors="replace") as fh:
                    out.append(f"--- {node}\n" + "\n".join(fh.read().splitlines()[-40:]))
            except FileNotFoundError:
                out.append(f"--- {node}: no log")
        return "\n".join(out) + "\n" + self.cluster.log_tail(15)


@contextlib.contextmanager
def submitted(job: Job) -> Iterator[Job]:
    """A test's job: its logs printed when an assertion fails, and cancelled at the end either way."""
    try:
        yield job
    except AssertionError:
        print(job.dump())
        raise
    finally:
        job.cancel()
        shutil.rmtree(memory_root(job.tmp), ignore_errors=True)  # the agents' tier-0 folder (empty once drained)


def emergency(job: Job) -> list[dict[str, Any]]:
    return [e for e in job.events("checkpoint_committed")
            if e.get("kind") == "emergency" and e.get("component") == "trainguard.worker"]


def slurm_lines(job: Job) -> list[str]:
    lines = []
    for path in job.logs.values():
        with open(path, errors="replace") as fh:
            lines += [line for line in fh.read().splitlines() if line.startswith("trainguard: from Slurm: ")]
    return lines


def wait_training(job: Job, min_step: int = 20, timeout: float = 180) -> None:
    wait_until(lambda: job.state() == "RUNNING", 60, f"job {job.id} running")
    wait_until(lambda: any(s >= min_step for s in job.steps_at(2)), timeout, f"{min_step} steps at world size 2")


def test_agents_take_their_config_from_slurm_and_scancel_usr1_drains(slurm_cluster, short_tmp):  # noqa: F811
    """examples/slurm/fixed.sbatch (``--gpus-per-node=0`` overrides its 8: no GPUs here)."""
    tmp = short_tmp
    with submitted(Job(slurm_cluster, tmp, "--gpus-per-node=0", script=FIXED_SCRIPT)) as job:
        wait_training(job)
        lines = slurm_lines(job)
        assert len(lines) == 2, lines  # one line per agent, saying what it took from where
        assert sorted(x.split("agent.node_name=")[1].split(" ")[0] for x in lines) == sorted(slurm_cluster.nodes)
        first = expand_hostlist(slurm_cluster.job_field(job.id, "NodeList"))[0]
        for line in lines:
            assert f"agent.job_id=slurm-{job.id} (SLURM_JOB_ID)" in line, line
            assert "rendezvous.min_nodes=2 (SLURM_JOB_NUM_NODES)" in line, line
            assert f"rendezvous.endpoint={first}:{15000 + int(job.id[-4:])} (first host of SLURM_JOB_NODELIST)" in line
            assert "preemption.sigusr1=true" in line
            # the script's own TRAINGUARD_PREEMPTION_SIGNAL_DEADLINE_S wins over GraceTime; nothing else was given
            assert line.endswith("set elsewhere (YAML, TRAINGUARD_* or a flag): preemption.signal_deadline_s"), line

        t0 = time.time()
        slurm_cluster.cmd("scancel", "--signal=USR1", job.id)
        notices = wait_until(lambda: job.events("preemption_notice"), 30, "both agents' notices")
        wait_until(lambda: job.state() in ("COMPLETED", "FAILED", "CANCELLED"), 120, "the job ends")
        done = time.time() - t0
        assert job.state() == "COMPLETED", job.dump()  # both agents drained and exited 0: srun and the job succeed
        assert slurm_cluster.job_field(job.id, "Restarts") == "0"  # a drain that is no preemption: not requeued
        notices = job.events("preemption_notice")
        assert len(notices) == 2 and all(n["detail"]["signal"] == "SIGUSR1" and n["kind"] == "preempt"
                                         and n["remaining_s"] == 110 for n in notices), notices
        committed = emergency(job)
        assert len(committed) == 2, job.dump()  # both ranks, the same step, before the deadline
        assert len({e["step"] for e in committed}) == 1 and all(e["before_deadline"] for e in committed)
        assert max(job.steps_at(2)) <= committed[0]["step"]  # nothing trained after the checkpoint: nothing lost
        assert not [e for e in job.events("state_change") if e.get("new") == "restarting"]
        print(f"scancel --signal=USR1 -> job COMPLETED in {done:.1f} s; emergency step {committed[0]['step']}")


def test_preempted_within_gracetime_then_the_requeued_job_resumes(slurm_cluster, short_tmp):  # noqa: F811
    """A job of partition ``high`` preempts ours (``PreemptMode=REQUEUE``, ``GraceTime``): SIGTERM to every
    agent with the grace as deadline (read from ``scontrol``), an emergency checkpoint inside it, the job
    requeued with the same id, and the second run continues from that checkpoint's step."""
    tmp = short_tmp
    with submitted(Job(slurm_cluster, tmp)) as job:  # examples/slurm/requeue.sbatch
        wait_training(job)
        line = slurm_lines(job)[0]
        assert f"preemption.signal_deadline_s={GRACE_S} (partition GraceTime (scontrol))" in line, line

        t0 = time.time()
        high = slurm_cluster.sbatch("-p", "high", "-N2", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 3")
        committed = wait_until(lambda: len(emergency(job)) == 2 and emergency(job), 90, "the emergency checkpoint")
        t_saved = time.time() - t0
        notices = job.events("preemption_notice")
        assert {n["detail"]["signal"] for n in notices} == {"SIGTERM"}, notices
        assert all(abs(n["remaining_s"] - GRACE_S) < 1e-6 for n in notices), notices
        assert len({e["step"] for e in committed}) == 1 and all(e["before_deadline"] for e in committed)
        assert t_saved < GRACE_S, f"the checkpoint took {t_saved:.1f} s, past GraceTime {GRACE_S} s"
        s = committed[0]["step"]

        wait_until(lambda: slurm_cluster.job_field(high, "JobState") == "COMPLETED", 120, "the preempting job")
        resumed = resumes_after_requeue(job, s)
        print(f"preempted -> emergency checkpoint of step {s} in {t_saved:.1f} s (GraceTime {GRACE_S} s); "
              f"requeued, resumed at step {resumed}")


def resumes_after_requeue(job: Job, step: int) -> int:
    """The job requeued once, started again at once, and its ranks resumed at ``step`` (the same job id found
    its emergency checkpoint) and trained on; returns the step they resumed at."""
    cluster = job.cluster
    wait_until(lambda: cluster.job_field(job.id, "Restarts") == "1", 120, "the job requeued")
    # Slurm holds a requeued batch job for about two minutes (its BeginTime); the test does not wait.
    wait_until(lambda: cluster.job_field(job.id, "JobState") == "PENDING", 60, "the job pending again")
    cluster.cmd("scontrol", "update", f"JobId={job.id}", "StartTime=now")
    resumed = wait_until(lambda: [e for e in job.events("resumed") if e.get("world_size") == 2], 240,
                         "the requeued job resumes")
    assert all(e["step"] == step for e in resumed), (resumed, step)
    wait_until(lambda: any(st > step + 5 for st in job.steps_at(2)), 120, "training after the requeue")
    lines = slurm_lines(job)
    assert len(lines) == 4 and all(f"agent.job_id=slurm-{job.id} " in x for x in lines), lines
    return int(resumed[0]["step"])


def test_scontrol_requeue_drains_and_the_job_resumes(slurm_cluster, short_tmp):  # noqa: F811
    """``scontrol requeue``: SIGTERM to the step (deadline: the shorter of GraceTime and KillWait), the agents
    drain, Slurm itself puts the job back in the queue, and the next run resumes at the emergency step."""
    with submitted(Job(slurm_cluster, short_tmp)) as job:  # examples/slurm/requeue.sbatch
        wait_training(job)
        slurm_cluster.cmd("scontrol", "requeue", job.id)
        committed = wait_until(lambda: len(emergency(job)) == 2 and emergency(job), 60, "the emergency checkpoint")
        assert len({e["step"] for e in committed}) == 1 and all(e["before_deadline"] for e in committed)
        assert {n["detail"]["signal"] for n in job.events("preemption_notice")} == {"SIGTERM"}
        s = committed[0]["step"]
        assert resumes_after_requeue(job, s) == s


def test_time_limit_notice_to_the_batch_shell_drains_and_requeues(slurm_cluster, short_tmp):  # noqa: F811
    """``#SBATCH --signal=B:USR1@180`` signals only the batch shell (here sent at once with ``scancel --batch``):
    requeue.sbatch forwards it to the step's agents, which drain, and requeues the job."""
    with submitted(Job(slurm_cluster, short_tmp)) as job:
        wait_training(job)
        slurm_cluster.cmd("scancel", "--batch", "--signal=USR1", job.id)
        committed = wait_until(lambda: len(emergency(job)) == 2 and emergency(job), 60, "the emergency checkpoint")
        assert len({e["step"] for e in committed}) == 1 and all(e["before_deadline"] for e in committed)
        assert {n["detail"]["signal"] for n in job.events("preemption_notice")} == {"SIGUSR1"}
        wait_until(lambda: slurm_cluster.job_field(job.id, "Restarts") == "1", 60, "the job requeued")
        wait_until(lambda: job.state() == "PENDING", 60, "the job pending again")
        with open(os.path.join(short_tmp, f"job-{job.id}.out")) as fh:
            assert "requeueing job" in fh.read()


def test_elastic_job_loses_its_first_node_and_trains_on(slurm_cluster, short_tmp):  # noqa: F811
    """examples/slurm/elastic.sbatch: the store runs in the batch step, the agents run ``--nnodes 1:2``. The agent
    on the first node of the nodelist (where a store inside an agent would live) drains; the other re-forms
    alone and trains on, on the same store. ``--gpus-per-node=0`` overrides the script's 8 (no GPUs here)."""
    job = Job(slurm_cluster, short_tmp, "--gpus-per-node=0", script=ELASTIC_SCRIPT, flags="--nnodes 1:2")
    with submitted(job):
        wait_training(job)
        first = expand_hostlist(slurm_cluster.job_field(job.id, "NodeList"))[0]
        other = next(n for n in slurm_cluster.nodes if n != first)
        for line in slurm_lines(job):
            assert line.endswith("set elsewhere (YAML, TRAINGUARD_* or a flag): rendezvous.min_nodes"), line
        assert not job.events("store_in_agent")  # is_host=false: the store is the batch step's
        sock = os.path.join(short_tmp, f"state-{first}", f"slurm-{job.id}.sock")
        subprocess.run([sys.executable, "-m", "trainguard.agent.cli", "drain", "--socket", sock, "--deadline", "30s"],
                       check=True, capture_output=True, timeout=60)
        step = max(job.steps_at(2))
        wait_until(lambda: any(st > step + 10 for st in job.steps_at(1)), 120, "the survivor training alone")
        assert job.state() == "RUNNING"
        print(f"elastic: {first} drained at step {step}; {other} trains on at world size 1 on the batch step's store")
    # cancelled (a signal ends the batch script): its store ends with it, no orphan outlives the job
    port = 15000 + int(job.id) % 10000
    wait_until(lambda: not _stores_on(port), 30, f"the batch step's store on port {port} ended with the job")


def _stores_on(port: int) -> list[int]:
    """Pids of ``trainguard store`` processes listening on ``--port port`` (from /proc)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                args = fh.read().split(b"\0")
        except OSError:
            continue
        if b"store" in args and any(a == b"--port" and b == str(port).encode() for a, b in zip(args, args[1:])):
            out.append(int(pid))
    return out
