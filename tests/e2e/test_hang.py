"""Dirty failures (issue 37): a hung rank and a frozen node cost seconds, not the process-group timeout.

Two agents x one worker of the bundled worker-API example on localhost. SIGSTOP is the fault: of one
worker (a hung rank: its agent alive) or of a whole node (agent and worker: a frozen node, its sockets
open). No timed assertion: the bench (bench/recovery.py, kinds hang_worker and freeze_node) shows the
times; these check who is named, what is done, and that the survivor never restarts."""

import os
import signal

import pytest

from tests.harness import REPO, Node, free_port, running, wait_listening, wait_until
from trainguard.agent.hang import HangConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ELASTIC = os.path.join(REPO, "examples", "train_gpt_elastic.py")
ARGS = ["--steps", "100000", "--log-every", "1", "--step-sleep", "0.03", "--global-batch", "24"]


def steps(*nodes):
    return [e for n in nodes for e in n.events("train_step")]


def training(a, b):
    """Wait for 30 steps at world size 2 (b may join a running world of 1); their worker pids."""
    def at_2():
        s2 = [e["step"] for e in steps(a, b) if e["world_size"] == 2]
        return s2 and max(s2) - min(s2) >= 30
    wait_until(at_2, 180, "30 steps at world size 2")
    return a.worker_pids(), b.worker_pids()


def two_nodes(tmp, keep_alive_s=1, frozen_s=None, probes=True):
    ep = f"127.0.0.1:{free_port()}"
    common = ["--set", f"checkpoint.url={os.path.join(tmp, 'ckpt')}", "--set", f"rendezvous.keep_alive_interval_s={keep_alive_s}",
              "--set", "rendezvous.keep_alive_max_attempts=3", "--set", "checkpoint.interval=20"]
    if frozen_s is not None:
        common += ["--set", f"hang.frozen_s={frozen_s}"]
    if not probes:
        common += ["--set", "hang.probe_timeout_s=0"]
    a = Node("a", tmp, ep, nnodes="1:2", script=ELASTIC, script_args=ARGS, extra=common)
    wait_listening(ep)
    b = Node("b", tmp, ep, nnodes="1:2", script=ELASTIC, script_args=ARGS, extra=common)
    return a, b


def test_a_stopped_worker_is_named_ended_and_rejoins_while_its_peer_re_forms_in_place(tmp_path):
    a, b = two_nodes(str(tmp_path))
    with running([a, b]):
        (pa,), (pb,) = training(a, b)
        os.kill(pb, signal.SIGSTOP)  # b's rank hangs; b's agent is alive
        stopped_at = max(e["step"] for e in steps(a, b))
        hung = wait_until(lambda: b.events("hang_detected"), 120, "b's agent detects the hang")[0]
        # b's agent reads its worker's /proc: stopped (state T), named after hang.stopped_s
        assert hung["action"] == "end_workers" and hung["culprit_by"] == "process_stopped"
        assert hung["threshold_s"] == HangConfig().stopped_s
        assert hung["node"] == "b" and hung["phase"] in ("step", "agreement")
        # its last beat (at most hang.heartbeat_interval_s old when it stopped; the step lines reach the log late)
        assert isinstance(hung["rank"], int) and abs(hung["step"] - stopped_at) <= 10 and hung["where"]
        assert hung["stalled_s"] >= 0  # the stop is the evidence: the job's stall is not waited for
        assert wait_until(lambda: b.events("hung_workers_ended"), 30, "b ends its hung worker")[0]["pids"] == [pb]
        # The survivor's collective failed (b's worker ended): it re-forms in place, b restarts its worker
        # and rejoins; training goes on at world size 2 past the hung step.
        wait_until(lambda: any(e["world_size"] == 2 and e["step"] > stopped_at + 10 for e in steps(a, b)), 120,
                   "training at world size 2 again")
        assert a.worker_pids() == [pa], "the survivor's worker was restarted"
        assert pb not in b.worker_pids()
        assert not [e for e in a.events("state_change") if e["new"] == "restarting"]
        assert [e for e in b.events("state_change") if e["new"] == "restarting"][0]["reason"] == "worker_hang"
        reformed = [e for e in a.events("worker_reformed") if e.get("reason") == "peer_lost"]
        assert reformed, "a did not re-form in place"
        # a may see the stall too (its own threshold), or b may end its worker first and a's collective
        # fails before then (a loaded machine): either way a only watches a hang that is not on its node.
        for seen_by_a in a.events("hang_detected"):
            assert seen_by_a["action"] == "watch" and seen_by_a["rank"] == hung["rank"], seen_by_a


@pytest.mark.parametrize("keep_alive_s,frozen_s,probes,path", [(1, 6, False, "member_lost"), (5, None, False, "node_silent"),
                                                              (5, None, True, "agent_unanswered")])
def test_a_frozen_node_is_evicted_by_its_peer_which_re_forms_in_place(tmp_path, keep_alive_s, frozen_s, probes, path):
    """Probes off (hang.probe_timeout_s 0: silence alone): keep-alive 1 s x 3 expires before hang.frozen_s set
    to 6 s, member_lost aborts; 5 s x 3 does not expire before the default hang.frozen_s (2 s): the hang watch
    names the frozen node (its agent and rank silent), aborts and evicts it from the rendezvous before its
    keep-alive expires. Probes on (the default): b's agent does not answer a's probe once its record is late,
    and a names it at hang.probe_after_s, without frozen_s of silence."""
    a, b = two_nodes(str(tmp_path), keep_alive_s, frozen_s, probes)
    with running([a, b]):
        (pa,), (pb,) = training(a, b)
        for pid in (b.pid, pb):  # the whole node freezes: agent and worker, sockets open
            os.kill(pid, signal.SIGSTOP)
        stopped_at = max(e["step"] for e in steps(a, b))
        try:
            # Whichever evidence comes first: a's hang watch (no progress, b's agent silent too: abort and
            # evict) or the expiry of b's keep-alive (member lost: abort). Either way a's worker aborts its
            # collective, parks and re-forms in place; it is never restarted.
            wait_until(lambda: a.events("collectives_abort_requested"), 120, "a aborts its worker's collectives")
            for hung in a.events("hang_detected"):
                assert hung["action"] == "abort" and hung["node_frozen"] and hung["node"] == "b"
            assert wait_until(lambda: a.events("collectives_aborted"), 30, "a's worker aborts")
            wait_until(lambda: any(e["world_size"] == 1 and e["step"] > stopped_at for e in steps(a)), 120,
                       "a trains on alone")
            assert [e for e in a.events("worker_reformed") if e.get("reason") == "peer_lost"]
            assert a.worker_pids() == [pa], "the survivor's worker was restarted"
            assert not [e for e in a.events("state_change") if e["new"] == "restarting"]
            if path != "member_lost":
                assert a.events("hang_detected") and not a.events("member_lost")
                hung = a.events("hang_detected")[0]
                assert hung["culprit_by"] == path
                if path == "agent_unanswered":  # named before frozen_s of silence would have
                    assert hung["threshold_s"] == HangConfig().ask_after_s < HangConfig().frozen_s
                frozen = hung["node_id"]
                assert [e["nodes"] for e in a.events("member_evicted")] == [[frozen]]  # before its keep-alive expired
            else:
                assert a.events("member_lost")
        finally:
            for pid in (b.pid, pb):
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass


from tests.e2e.test_ha_rendezvous import external_store  # noqa: E402,F401  (the fixture: a `trainguard store`)


def test_a_node_that_joins_a_job_that_completed_exits_0_not_needed(tmp_path, external_store):  # noqa: F811
    """A spare node whose agent joins when the job has completed (the rendezvous, in a store of its own,
    is closed): exit 0 with one clear line, not exit 1 with supervisor_crashed."""
    tmp = str(tmp_path)
    extra = ["--set", "rendezvous.is_host=false", "--set", f"checkpoint.url={os.path.join(tmp, 'ckpt')}"]
    done = ["--steps", "20", "--log-every", "5", "--step-sleep", "0.01", "--global-batch", "24"]
    a = Node("a", tmp, external_store, nnodes="1:2", script=ELASTIC, script_args=done, extra=extra)
    with running([a]) as nodes:
        assert a.wait(180) == 0
        b = Node("b", tmp, external_store, nnodes="1:2", script=ELASTIC, script_args=done, extra=extra)
        nodes.append(b)
        assert b.wait(180) == 0
        line = wait_until(lambda: b.events("job_already_complete"), 10, "b's line")[0]
        assert "not needed" in line["effect"]
        assert not b.events("supervisor_crashed")
        assert [e for e in b.events("agent_exit")][-1]["outcome"] == "succeeded"
