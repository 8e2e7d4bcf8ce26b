"""Every notice source drains the node the same way; two nodes can leave at once."""

import os
import time

import pytest

from tests.emulators.fixtures import aws_imds, azure_events, gcp_metadata  # noqa: F401
from tests.harness import REPO, Node, continued, free_port, notice_checkpoints, wait_listening, wait_until
from trainguard.agent import control
from trainguard.agent.exitcodes import ExitCode
from trainguard.contract.protocol import DrainRequest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
ELASTIC = os.path.join(REPO, "examples", "train_gpt_elastic.py")
ARGS = ["--steps", "100000", "--log-every", "5", "--step-sleep", "0.03", "--global-batch", "24"]


def worlds(node):
    return [e["world_size"] for e in node.events("rendezvous_complete")]


def emergency_steps(*nodes):
    return [e["step"] for n in nodes for e in n.events("checkpoint_committed")
            if e.get("kind") == "emergency" and e.get("component") == "trainguard.worker"]


def start_cluster(tmp, names, extra_for):
    ep = f"127.0.0.1:{free_port()}"
    # Drain at the notice (the default trains through a cloud notice until the drain lead: test_drain.py)
    common = ["--set", f"checkpoint.url={os.path.join(tmp, 'ckpt')}", "--set", "preemption.train_through_notice=false"]
    nodes = []
    for i, name in enumerate(names):
        nodes.append(Node(name, tmp, ep, nnodes=f"1:{len(names)}", script=ELASTIC, script_args=ARGS,
                          extra=common + extra_for.get(name, [])))
        if i == 0:
            wait_listening(ep)  # the first node hosts the c10d store
    wait_until(lambda: all(worlds(n)[-1:] == [len(names)] for n in nodes), 120, f"world size {len(names)}")
    wait_until(lambda: sum(len(n.events("train_step")) for n in nodes) >= 3, 90, "training")
    return nodes


def timeout_stop_sec():
    """TimeoutStopSec of the shipped unit: a SIGTERMed agent must be gone well within it."""
    with open(os.path.join(REPO, "systemd", "trainguard-agent.service")) as fh:
        for line in fh:
            if line.strip().startswith("TimeoutStopSec="):
                return float(line.split("=", 1)[1].strip().rstrip("s"))
    raise AssertionError("TimeoutStopSec missing from systemd/trainguard-agent.service")


def survivor_resumes(survivor, leavers, expected_world, code=ExitCode.DRAINED):
    for n in leavers:
        assert n.wait(90) == code, n.dump()
    steps = emergency_steps(survivor, *leavers)
    assert steps and len(set(steps)) == 1, steps  # every rank stopped at the same step
    s = steps[0]
    wait_until(lambda: worlds(survivor)[-1:] == [expected_world], 60, f"survivor at {expected_world}")
    resumed = wait_until(lambda: continued(survivor, expected_world), 60, "resume")
    assert resumed[-1]["step"] == s
    assert not [e for e in survivor.events("state_change") if e["new"] == "restarting"]
    return s


@pytest.mark.parametrize("source", ["gcp", "azure", "sigterm", "sigterm-during-async-save"])
def test_notice_source_drains_node(tmp_path, source, request):
    tmp = str(tmp_path)
    extra_b = []
    emu = None
    if source == "gcp":
        emu = request.getfixturevalue("gcp_metadata")
        extra_b = ["--set", "preemption.sources=gcp", "--set", f"preemption.gcp_endpoint={emu.url}"]
    elif source == "azure":
        emu = request.getfixturevalue("azure_events")
        extra_b = ["--set", "preemption.sources=azure", "--set", f"preemption.azure_endpoint={emu.url}",
                   "--set", "preemption.poll_interval_s=0.5", "--set", f"preemption.azure_vm_name={emu.vm_name}"]
    extra_all = ["--set", "checkpoint.interval_steps=1"] if source == "sigterm-during-async-save" else []
    a, b = nodes = start_cluster(tmp, ["a", "b"], {"a": extra_all, "b": extra_b + extra_all})
    try:
        if source == "gcp":
            emu.preempt()
        elif source == "azure":
            event_id = emu.preempt(in_s=30)
        else:
            t_term = time.monotonic()
            b.signal(15)
        s = survivor_resumes(a, [b], 1, ExitCode.STOPPED if source.startswith("sigterm") else ExitCode.DRAINED)
        if source.startswith("sigterm"):
            # systemd's stop: a drain with a committed checkpoint, exit 4 (stopped), well inside TimeoutStopSec
            assert time.monotonic() - t_term < timeout_stop_sec()
        if source == "azure":
            wait_until(lambda: emu.count("/metadata/scheduledevents", method="POST") >= 1, 10, "StartRequests")
            assert any(e.get("source") == "azure" for e in b.events("notice_acknowledged")), event_id
        if source == "sigterm-during-async-save":
            periodic = [e["step"] for e in a.events("checkpoint_committed") if e.get("kind") == "periodic"]
            assert periodic and min(periodic) < s and s not in periodic  # in flight around the notice; none is step s
        first = [e for e in b.events("state_change") if e["new"] == "draining"][0]
        assert first["source"] == ("signal" if source.startswith("sigterm") else source)
    except AssertionError:
        print(a.dump(60), b.dump(60), sep="\n")
        raise
    finally:
        for n in nodes:
            n.stop()


def test_two_notices_on_two_of_three_nodes(tmp_path):
    tmp = str(tmp_path)
    nodes = start_cluster(tmp, ["a", "b", "c"], {})
    a, b, c = nodes
    try:
        for n in (b, c):
            assert control.request(n.socket, DrainRequest(deadline_s=60, reason="test")).ok
        survivor_resumes(a, [b, c], 1)
        wait_until(lambda: any(e["world_size"] == 1 for e in a.events("train_step")), 60, "training at 1")
    except AssertionError:
        print(a.dump(60), b.dump(60), c.dump(40), sep="\n")
        raise
    finally:
        for n in nodes:
            n.stop()


def test_early_warnings_checkpoint_and_stay_a_spot_interruption_drains_a_rendezvous_drain_leaves_fast(
        tmp_path, aws_imds, gcp_metadata):  # noqa: F811
    """One generation of processes, four policy outcomes: an AWS rebalance recommendation and a GCP
    live migration each give exactly one out-of-cycle checkpoint with node b staying in the job; the
    spot interruption then drains b; a node drained while it waits in a rendezvous leaves within 2 s."""
    tmp = str(tmp_path)
    extra_b = ["--set", "preemption.sources=aws,gcp", "--set", f"preemption.aws_endpoint={aws_imds.url}",
               "--set", f"preemption.gcp_endpoint={gcp_metadata.url}", "--set", "preemption.poll_interval_s=0.3"]
    a, b = nodes = start_cluster(tmp, ["a", "b"], {"b": extra_b})
    # A lone node of another job that needs 2 nodes: it waits in its rendezvous.
    lone = Node("lone", tmp, f"127.0.0.1:{free_port()}", nnodes="2:2", job="other", script=ELASTIC, script_args=ARGS)
    nodes.append(lone)

    def notice_ckpts():
        return notice_checkpoints(a, b)

    try:
        aws_imds.rebalance()
        wait_until(lambda: len(notice_ckpts()) == 2, 60, "one out-of-cycle checkpoint on both ranks")
        first = notice_ckpts()
        assert first[0]["step"] == first[1]["step"]  # every rank saved the same step
        gcp_metadata.maintenance("MIGRATE_ON_HOST_MAINTENANCE")
        wait_until(lambda: len(notice_ckpts()) == 4, 60, "a second out-of-cycle checkpoint")
        assert b.proc.poll() is None and worlds(a)[-1:] == [2] and worlds(b)[-1:] == [2]  # b stayed
        assert not emergency_steps(a, b)
        actions = [e["action"] for e in b.events("notice_decision")]
        assert actions == ["checkpoint", "checkpoint"], actions

        wait_until(lambda: lone.events("state_change") and lone.events("state_change")[-1]["new"] == "rendezvous",
                   60, "the lone node waiting in its rendezvous")
        t0 = time.monotonic()
        # The deadline is 10 minutes away: a node that waited for it (deadline - 2 s, the old
        # behaviour) would still be here; one that aborts its rendezvous leaves within seconds.
        assert control.request(lone.socket, DrainRequest(deadline_s=600, reason="test")).ok
        assert lone.wait(60) == ExitCode.DRAINED, lone.dump()
        print(f"the lone node left {time.monotonic() - t0:.2f} s after the drain (deadline in 600 s)")
        stopped = lone.events("state_change")[-1]
        assert stopped["new"] == "stopped" and stopped["reason"] == "drained_during_rendezvous"

        aws_imds.schedule_termination(in_s=120)
        survivor_resumes(a, [b], 1)
        assert [e["action"] for e in b.events("notice_decision")][-1] == "drain"
    except AssertionError:
        print(a.dump(60), b.dump(60), lone.dump(30), sep="\n")
        raise
    finally:
        for n in nodes:
            n.stop()
