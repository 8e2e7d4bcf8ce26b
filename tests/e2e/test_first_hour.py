"""A new user's first hour, through the CLI only, in one scenario (two `trainguard run --standalone`
agents on one host, as a user would start them):

* A (``checkpoint.url`` set, 2 workers) gets a job id derived from the script and its arguments and
  prints its drain command; B (no ``checkpoint.url``, canary secrets in YAML, env and arguments) gets
  a random one.
* ``trainguard status`` / ``drain`` with no flags list both agents and exit 2; ``--job-id`` picks one;
  ``status`` before the first checkpoint says "none yet".
* The same command as A again is refused while A runs (one agent per control socket).
* Draining B (worker API, no checkpoint URL): the runtime warned at start, the agent reports the
  emergency "checkpoint" as not saved. Then ``trainguard drain`` finds A alone and drains it.
* None of the canary secrets appears in any log line, worker log file or ``/metrics`` scrape.
* torch's child-thread signal-handler warning and its ``failed (exitcode: 75)`` line never show.
* Re-running A's command resumes from A's emergency step, trains to the end, and saves a ``final``
  checkpoint of the last step (or finds it saved by the periodic interval), in the same run folder;
  ``checkpoints show <run folder> STEP`` works.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest

from tests.harness import REPO, short_tmp, wait_until  # noqa: F401 - short_tmp: a fixture
from trainguard.agent.exitcodes import ExitCode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ELASTIC = os.path.join(REPO, "examples", "train_gpt_elastic.py")
STEPS = 80
CANARIES = ["sk-canary-yaml-key-1f3e", "canary-private-key-77ab", "canary-wandb-9c2d", "canary-db-passwd-5e8a",
            "canary-arg-value-4b1c"]


class Run:
    """One ``trainguard run`` process, its merged output in a file."""

    def __init__(self, name: str, tmp: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.log_path = os.path.join(tmp, f"{name}.log")
        self._fh = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "trainguard.agent.cli", "run", *argv], stdout=self._fh,
                                     stderr=subprocess.STDOUT, env=env, cwd=tmp)

    def text(self) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()

    def events(self, name: str) -> list[dict]:
        out = []
        for line in self.text().splitlines():
            line = line.split("]:", 1)[1] if line.startswith("[default") else line
            if line.startswith("{"):
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if ev.get("event") == name:
                    out.append(ev)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._fh.close()


def test_first_hour(short_tmp):
    tmp = short_tmp
    ckpt = os.path.join(tmp, "ckpt")
    # TMPDIR moves the per-user private base (/tmp/trainguard-<uid>) into this test's folder: the CLI
    # finds the agents there with no flags, and nothing of other tests' agents is in the way.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TRAINGUARD_") and k not in ("XDG_RUNTIME_DIR", "RUNTIME_DIRECTORY", "OMP_NUM_THREADS")}
    env.update({"TMPDIR": tmp, "PYTHONUNBUFFERED": "1"})
    common = ["--set", "agent.log_format=json", "--set", "preemption.sources=signal", "--set", "metrics.port=0",
              "--monitor-interval", "0.2"]
    small = ["--d-model", "32", "--layers", "1", "--max-bytes", "200000", "--global-batch", "8", "--micro-batch", "2",
             "--log-every", "1", "--step-sleep", "0.25"]
    a_argv = ["--standalone", "--nproc-per-node", "2", *common, "--set", f"checkpoint.url=file://{ckpt}",
              ELASTIC, "--steps", str(STEPS), *small]
    b_yaml = os.path.join(tmp, "b.yaml")
    with open(b_yaml, "w") as fh:
        fh.write(f"checkpoint:\n  storage_options:\n    key: {CANARIES[0]}\n    token: {{private_key: {CANARIES[1]}}}\n")
    b_env = {**env, "OMP_NUM_THREADS": "1",
             "TRAINGUARD_WORKERS_ENV": json.dumps({"WANDB_API_KEY": CANARIES[2], "DB_PASSWD": CANARIES[3]})}
    b_argv = ["--standalone", "--config", b_yaml, *common, ELASTIC, "--steps", "100000", *small,
              "--deepspeed-config", CANARIES[4]]

    def cli(*argv: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "trainguard.agent.cli", *argv], capture_output=True, text=True,
                              timeout=60, env={**env, **(extra_env or {})}, cwd=tmp)

    runs: list[Run] = []
    try:
        a = Run("a", tmp, a_argv, env)
        b = Run("b", tmp, b_argv, b_env)
        runs += [a, b]
        job_a = wait_until(lambda: a.events("agent_control"), 60, "A's agent_control")[0]["job_id"]
        job_b = wait_until(lambda: b.events("agent_control"), 60, "B's agent_control")[0]["job_id"]
        wait_until(lambda: a.events("train_step") and b.events("train_step"), 120, "both training")
        assert job_a.startswith("train_gpt_elastic-") and len(job_b) == 12, (job_a, job_b)
        assert f"trainguard: job id {job_a} (from the script and its arguments" in a.text()
        assert "drain it with `trainguard drain`" in a.text()
        assert a.events("omp_num_threads_defaulted") and not b.events("omp_num_threads_defaulted")

        # several agents: no-flag status and drain list them and exit 2
        for cmd in ("status", "drain"):
            r = cli(cmd)
            assert r.returncode == 2 and "2 live agents" in r.stderr, r.stderr
            assert job_a in r.stderr and job_b in r.stderr and "--job-id" in r.stderr and "Traceback" not in r.stderr
        r = cli("status", "--job-id", job_a)
        assert r.returncode == 0, r.stderr
        assert f"found the agent of job {job_a}" in r.stderr
        assert "state             running" in r.stdout and "last checkpoint   none yet" in r.stdout, r.stdout

        # the same command again while A runs: refused before anything starts
        again = cli("run", *a_argv)
        assert again.returncode == 2, again.stderr
        assert f"another agent is already running job '{job_a}'" in again.stderr and "Traceback" not in again.stderr

        # B: worker API without checkpoint.url -> warned at start, the drain reports "not saved"
        metrics_b = wait_until(lambda: b.events("metrics_serving"), 30, "B's exporter")[0]["url"]
        with urllib.request.urlopen(metrics_b + "/metrics", timeout=10) as resp:
            scrape_b = resp.read().decode()
        r = cli("drain", "--job-id", job_b)
        assert r.returncode == 0 and f"drain of job {job_b} on node" in r.stdout, r.stdout + r.stderr
        assert b.proc.wait(60) == ExitCode.DRAINED, b.text()[-3000:]
        assert b.events("checkpoint_url_unset"), "agent and runtime warn at start"
        assert any(e.get("component") == "trainguard.worker" for e in b.events("checkpoint_url_unset"))
        [not_saved] = [e for e in b.events("checkpoint_not_saved") if e.get("component") == "trainguard.agent.supervisor"]
        assert not_saved["kind"] == "emergency" and not_saved["step"] > 0

        # now A is the only one: found with no flags, drained with an emergency checkpoint
        r = cli("drain")
        assert r.returncode == 0, r.stderr
        assert f"found the agent of job {job_a}" in r.stderr
        assert a.proc.wait(90) == ExitCode.DRAINED, a.text()[-3000:]
        emergency = [e["step"] for e in a.events("checkpoint_committed")
                     if e.get("kind") == "emergency" and e.get("component") == "trainguard.worker"]
        assert emergency and len(set(emergency)) == 1, emergency
        s = emergency[0]
        assert 0 < s < STEPS
        # tier 0 is on by default where a checkpoint url is set: A's agent made its node's snapshot folder
        # (its DDP workers re-form in place: they take no snapshots) and removed it when it drained; B (no
        # checkpoint url) made none
        ready = a.events("memory_tier_ready")
        assert ready and a.events("memory_tier_removed"), "A: tier 0 on by default"
        assert not any(os.path.exists(e["path"]) for e in ready)
        assert not b.events("memory_tier_ready")

        # no secret anywhere: agent/worker output, per-rank log files, /metrics
        texts = {"b.log": b.text(), "a.log": a.text(), "metrics": scrape_b}
        for root, _, names in os.walk(os.path.join(tmp, f"trainguard-{os.getuid()}", "logs")):
            for n in names:
                with open(os.path.join(root, n), errors="replace") as fh:
                    texts[os.path.join(root, n)] = fh.read()
        assert len(texts) > 4, sorted(texts)  # the worker log files were found
        for where, text in texts.items():
            for c in CANARIES:
                assert c not in text, f"secret {c} printed in {where}"
        assert '"WANDB_API_KEY": "***"' in b.text() and "--deepspeed-config" in b.text()  # the config was logged

        # torch's misleading lines are gone, explained once in our words
        for run in (a, b):
            assert "Failed to register signal handlers" not in run.text()
            assert "failed (exitcode: 75)" not in run.text()
            assert len(run.events("orphan_safety")) == 1

        # the same command resumes from A's newest (emergency) step and ends with a final checkpoint
        a2 = Run("a2", tmp, a_argv, env)
        runs.append(a2)
        assert a2.proc.wait(180) == 0, a2.text()[-3000:]
        assert a2.events("agent_control")[0]["job_id"] == job_a
        restored = {e["step"] for e in a2.events("worker_restored")}
        assert restored == {s}, restored
        assert [e["step"] for e in a2.events("resumed")] == [s]
        # the last step is saved: as ``final`` by finish(), or, when the auto interval's periodic save fell
        # on it (the interval depends on measured save times, so it varies with the machine's load), by
        # that save, which finish() then does not repeat
        last = {e["kind"] for e in a2.events("checkpoint_committed") if e.get("step") == STEPS}
        assert last in ({"final"}, {"periodic"}), [(e.get("step"), e.get("kind"), e.get("component"))
                                                  for e in a2.events("checkpoint_committed")]
        [kind] = last
        assert os.listdir(ckpt) == [job_a], os.listdir(ckpt)  # one run folder: the re-run found its own
        shown = cli("checkpoints", "show", os.path.join(ckpt, job_a), str(STEPS))
        assert shown.returncode == 0 and f"kind        {kind}" in shown.stdout, shown.stdout + shown.stderr
    except AssertionError:
        for r in runs:
            print(f"--- {r.name} ---\n" + "\n".join(r.text().splitlines()[-40:]))
        raise
    finally:
        for r in runs:
            r.stop()
