"""The heart: a spot notice on one node -> emergency checkpoint on every rank -> the survivor goes on
at the new world size from the next step -> the node rejoins. Every sample is used exactly once.

The survivor's in-place re-formation is made to fail once (the test fault hook), so this is the
fallback path: the survivor's worker exits with the resize code and the world restarts from the
emergency checkpoint (the path every membership change took before in-place re-formation, and the one
scripts without the worker API take). The rejoin then re-forms in place."""

import json
import os
import time

import pytest

from tests.emulators.fixtures import aws_imds  # noqa: F401
from tests import samples
from tests.harness import REPO, Node, continued, free_port, notice_checkpoints, running, wait_listening, wait_until
from trainguard.agent.exitcodes import ExitCode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ELASTIC = os.path.join(REPO, "examples", "train_gpt_elastic.py")
GLOBAL_BATCH = 24


def worlds(node):
    return [e["world_size"] for e in node.events("rendezvous_complete")]


def sample_log(tmp):
    return os.path.join(tmp, "samples")


def check_exactly_once(folder):
    """Each step committed once with the whole global batch; each id once overall (``tests/samples.py``)."""
    return samples.check_exactly_once(folder, GLOBAL_BATCH)


def start_pair(tmp: str, aws_url: str, a_extra: list[str] = ()) -> tuple[str, list[str], list[str], Node, Node]:
    """Nodes a (hosting the c10d store) and b (watching the AWS emulator: the node that leaves), training
    the bundled job with a sample log. Returns the endpoint, the common flags, the job's arguments and
    the two nodes."""
    os.makedirs(os.path.join(tmp, "samples"))
    ep = f"127.0.0.1:{free_port()}"
    common = ["--set", f"checkpoint.url={os.path.join(tmp, 'ckpt')}", "--set", "checkpoint.interval_steps=15"]
    args = ["--steps", "100000", "--log-every", "5", "--step-sleep", "0.03", "--global-batch", str(GLOBAL_BATCH),
            "--sample-log", sample_log(tmp)]
    a = Node("a", tmp, ep, nnodes="1:2", script=ELASTIC, script_args=args, extra=common + list(a_extra))
    wait_listening(ep)
    b = Node("b", tmp, ep, nnodes="1:2", script=ELASTIC, script_args=args,
             extra=common + ["--set", "preemption.sources=aws", "--set", f"preemption.aws_endpoint={aws_url}",
                             "--set", "preemption.poll_interval_s=0.5"])
    return ep, common, args, a, b


def test_aws_notice_drains_node_b_survivor_resumes_then_b_rejoins(tmp_path, aws_imds):  # noqa: F811
    tmp = str(tmp_path)
    flag = os.path.join(tmp, "reform-fault-fired")
    fault = ["--set", "workers.env=" + json.dumps({"TRAINGUARD_RT_INJECT_FAULT": f"reform:{flag}"})]
    with open(flag, "w") as fh:  # held back (the worker checks the file at each re-formation) until armed below
        fh.write("held back\n")
    ep, common, args, a, b = start_pair(tmp, aws_imds.url, fault)
    nodes = [a, b]
    try:
        wait_until(lambda: worlds(a)[-1:] == [2] and worlds(b)[-1:] == [2], 90, "world size 2")
        wait_until(lambda: any(e["world_size"] == 2 and e["step"] >= 20 for e in a.events("train_step")), 90,
                   "20 steps at world 2")
        # Armed now: a may have formed a world alone before b's agent came up (nnodes 1:2 on a loaded
        # machine), and that growth must not take the fault meant for the drain's re-formation.
        os.remove(flag)

        # A spot interruption 25 s out, for node b only, with the defaults (train_through_notice,
        # drain_lead_s: auto): b checkpoints at once, trains on, and drains the lead before the deadline;
        # its steps and checkpoints are far under a second, so the lead is the 10 s floor.
        t_notice = time.time()
        deadline = int(t_notice + 25)  # AWS times have whole seconds
        aws_imds.schedule_termination(in_s=25)
        (decided,) = wait_until(lambda: b.events("notice_decision"), 30, "b decides on its notice")
        assert decided["action"] == "checkpoint" and decided["drain_lead_basis"] == "floor", decided
        assert decided["drain_lead_s"] == 10.0 and 12 <= decided["drain_in_s"] <= 15, decided
        insured = wait_until(lambda: notice_checkpoints(a, b), 30, "the insurance checkpoint on both ranks")
        time.sleep(max(0.0, deadline - 12 - time.time()))  # inside the notice, before the drain is due
        assert b.proc.poll() is None and worlds(a)[-1:] == [2], "b left at its notice instead of training on"
        assert any(e["world_size"] == 2 and e["step"] >= insured[0]["step"] + 20 for e in a.events("train_step")), \
            "the world did not train on through the notice"
        assert b.wait(90) == ExitCode.DRAINED, b.dump()
        t_gone = time.time()
        assert deadline - 12 <= t_gone <= deadline, (t_notice, deadline, t_gone)  # drained the lead before it
        committed = [e for n in (a, b) for e in n.events("checkpoint_committed")
                     if e.get("kind") == "emergency" and e.get("component") == "trainguard.worker"]
        assert committed, a.dump() + b.dump()
        s = committed[0]["step"]
        assert all(e["step"] == s for e in committed)  # every rank stopped at the same step
        assert all(e["before_deadline"] for e in committed)

        wait_until(lambda: worlds(a)[-1:] == [1], 60, "survivor at world size 1")
        resumed = wait_until(lambda: [e for e in a.events("resumed") if e["world_size"] == 1], 60, "resume at 1")
        assert resumed[0]["step"] == s  # continues at s + 1: nothing lost, nothing redone
        assert os.path.exists(flag) and a.events("reform_failed"), "the fallback was not exercised"
        t_resume = time.time()
        restarts_left = [e for e in a.events("state_change") if e["new"] == "restarting"]
        assert not restarts_left, "a planned drain must not consume a restart"
        wait_until(lambda: any(e["step"] >= s + 10 and e["world_size"] == 1 for e in a.events("train_step")), 90,
                   "training at world size 1")

        pids = a.worker_pids()
        aws_imds.clear()
        b2 = Node("b2", tmp, ep, nnodes="1:2", script=ELASTIC, script_args=args, extra=common)
        nodes.append(b2)
        wait_until(lambda: worlds(a)[-1:] == [2] and worlds(b2) == [2], 90, "world size 2 again")
        # The example's rank 0 prints, and the rendezvous orders the agents by pid: b2 is rank 0 when pids
        # wrapped (pid_max 32768 here; a suite starts thousands of processes). So read a's own worker:
        # in place this time, it re-forms (as rank 0 or 1) and the warmed-up joiner takes its state.
        r2 = wait_until(lambda: [e for e in a.events("worker_reformed") if e["world_size"] == 2 and e["step"] > s], 60,
                        "continue at 2")
        assert r2[-1]["reason"] == "resize" and b2.events("joiner_warm")
        wait_until(lambda: any(e["world_size"] == 2 and e["step"] > r2[-1]["step"] + 5
                               for n in (a, b2) for e in n.events("train_step")), 90, "training at world size 2 again")
        assert a.worker_pids() == pids, "a's worker was restarted by b2's join"
        for n in (a, b2):
            n.signal(15)
        for n in (a, b2):
            n.wait(60)
        assert not [e for e in a.events("state_change") if e["new"] == "restarting"]
        seen = check_exactly_once(sample_log(tmp))
        print(f"notice_to_resume_s={t_resume - t_notice:.1f} steps={len(seen) // GLOBAL_BATCH} emergency_step={s}")
    except AssertionError:
        print(*(n.dump(60) for n in nodes), sep="\n")
        raise
    finally:
        for n in nodes:
            n.stop()


def test_reclaimed_early_while_training_through_its_notice(tmp_path, aws_imds):  # noqa: F811
    """Training through a notice (the default) bets that the provider keeps its deadline; the insurance
    checkpoint and the in-memory world are what is left when it does not. b gets a 30 s notice: both
    ranks checkpoint the same step at once and train on; a few seconds later the whole node vanishes
    (agent and worker SIGKILLed), long before its drain was due. The survivor re-forms alone and trains
    on; every sample is used exactly once (the interrupted step is redone, nothing else)."""
    tmp = str(tmp_path)
    *_, a, b = start_pair(tmp, aws_imds.url)
    with running([a, b], tail=60):
        wait_until(lambda: worlds(a)[-1:] == [2] and worlds(b)[-1:] == [2], 90, "world size 2")
        wait_until(lambda: any(e["world_size"] == 2 and e["step"] >= 10 for e in a.events("train_step")), 90,
                   "10 steps at world 2")
        aws_imds.schedule_termination(in_s=30)
        insured = wait_until(lambda: notice_checkpoints(a, b), 30, "the insurance checkpoint")
        assert len({e["step"] for e in insured}) == 1, insured
        time.sleep(3)
        assert not [e for e in b.events("state_change") if e["new"] == "draining"], "b drained at its notice"
        b.stop()  # the provider takes the node 25 s early
        wait_until(lambda: worlds(a)[-1:] == [1], 60, "the survivor at world size 1")
        again = wait_until(lambda: continued(a, 1), 60, "the survivor continues")
        wait_until(lambda: any(e["world_size"] == 1 and e["step"] >= again[-1]["step"] + 10
                               for e in a.events("train_step")), 90, "training at world size 1")
        a.signal(15)
        assert a.wait(60) == ExitCode.STOPPED, a.dump()
        seen = check_exactly_once(sample_log(tmp))
        print(f"insured at step {insured[0]['step']}, continued at {again[-1]['step']} ({again[-1]['event']}), "
              f"steps={len(seen) // GLOBAL_BATCH}")
