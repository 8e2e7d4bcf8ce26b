"""A drain whose emergency checkpoint cannot finish before the deadline (issue 42: the abandoned
checkpoint that cost the 25 MB/s spot replays a restart of the whole world from storage).

Node b gets a notice 6 s out and freezes (SIGSTOP, the test fault hook ``freeze_emergency_save``) as its
worker starts the emergency save: its sockets stay open, so node a's save waits in a collective with it
until the drain deadline and abandons it. Before, a's worker then exited with the resize code and the
world restarted from the newest commit (the steps since lost, every process restarted, the state read
back from storage). Now a's worker re-forms in place without b from the live state of the agreed step:
same pid, the next step next, nothing rolled back, nothing committed under the abandoned save."""

import json
import os
import signal

import pytest

from tests import samples
from tests.harness import REPO, Node, free_port, running, wait_listening, wait_until
from trainguard.agent.exitcodes import ExitCode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ELASTIC = os.path.join(REPO, "examples", "train_gpt_elastic.py")
GLOBAL_BATCH = 24


def test_a_survivor_whose_emergency_save_is_cut_off_reforms_in_place_from_memory(tmp_path):
    tmp = str(tmp_path)
    folder = os.path.join(tmp, "samples")
    os.makedirs(folder)
    ckpt = os.path.join(tmp, "ckpt")
    flag = os.path.join(tmp, "frozen")
    ep = f"127.0.0.1:{free_port()}"
    common = ["--set", f"checkpoint.url={ckpt}", "--set", "checkpoint.interval_steps=15"]
    args = ["--steps", "100000", "--log-every", "1", "--step-sleep", "0.03", "--global-batch", str(GLOBAL_BATCH),
            "--sample-log", folder]
    a = Node("a", tmp, ep, nnodes="1:2", script=ELASTIC, script_args=args, extra=common)
    wait_listening(ep)
    b = Node("b", tmp, ep, nnodes="1:2", script=ELASTIC, script_args=args,
             extra=common + ["--set", "preemption.signal_deadline_s=6", "--set",
                             "workers.env=" + json.dumps({"TRAINGUARD_RT_INJECT_FAULT": f"freeze_emergency_save:{flag}"})])
    with running([a, b], tail=80):
        def at_2():
            s2 = [e["step"] for n in (a, b) for e in n.events("train_step") if e["world_size"] == 2]
            return s2 and max(s2) >= 20
        wait_until(at_2, 180, "20 steps at world size 2")
        (pa,) = a.worker_pids()
        b.signal(signal.SIGTERM)  # a notice 6 s out (preemption.signal_deadline_s)

        wait_until(lambda: os.path.exists(flag), 30, "b's worker frozen at the start of its emergency save")
        [abandoned] = wait_until(lambda: [e for e in a.events("checkpoint_abandoned")
                                          if e.get("component") == "trainguard.worker"], 60, "a abandons its save")
        s = abandoned["step"]
        assert abandoned["in_place"] is True, abandoned
        assert b.wait(60) in (ExitCode.DRAINED, ExitCode.WORK_LOST), b.dump()

        # a re-forms in place alone, from the live state of step s: it goes on at s + 1
        [reformed] = wait_until(lambda: [e for e in a.events("worker_reformed") if e["world_size"] == 1], 60,
                                "a re-formed at world size 1")
        assert reformed["reason"] == "peer_lost" and reformed["step"] == s, reformed
        wait_until(lambda: any(e["world_size"] == 1 and e["step"] >= s + 10 for e in a.events("train_step")), 90,
                   "a trains on at world size 1")
        # Count from a's last step at world size 2 (a may have trained alone before b's agent came up, nnodes 1:2
        # on a loaded machine), in the order of the job's own step lines: the runtime's worker_reformed line goes
        # to the other stream, relayed apart (it came after step s + 1's line in the suite run at bea8b36).
        trained = [(e["step"], e["world_size"]) for e in a.events("train_step")]
        last_at_2 = max(k for k, (_, size) in enumerate(trained) if size == 2)
        first = next(step for step, size in trained[last_at_2 + 1:] if size == 1)
        assert first == s + 1, (first, s)  # nothing rolled back to the last commit, nothing skipped
        assert a.worker_pids() == [pa], "a's worker was restarted"
        assert not [e for e in a.events("state_change") if e["new"] == "restarting"], a.dump()
        assert not [e for e in a.events("resumed")], "a restored from storage"
        a.signal(signal.SIGTERM)
        assert a.wait(60) == ExitCode.STOPPED, a.dump()
    # every sample once in the final lineage, and the abandoned save of step s never committed
    samples.check_lineage_exactly_once(folder, GLOBAL_BATCH)
    run_dirs = [os.path.join(ckpt, d) for d in os.listdir(ckpt)]
    steps = {name for d in run_dirs if os.path.isdir(d) for name in os.listdir(d)
             if os.path.exists(os.path.join(d, name, "manifest.json"))}
    assert not [n for n in steps if n.startswith(f"step-{s:012d}-")], (s, sorted(steps))
