"""The exit barrier counts only the members still in the round (issue 37, chaos ``late_joiner``).

Three agents x one worker of a plain gloo job (``_end_of_job.py``) on localhost, agent a hosting the c10d
store. Node c's worker fails right after the others finished: c's agent restarts it and leaves the round
(for the next one, which never comes: the job is over). torch elastic's barrier made a and b wait for c
until ``workers.exit_barrier_timeout_s``; ours lets them go once c left, and a, the store's host, stays
until c learnt that the job is over and exited 0 (``not_needed``). No timed assertion: the barrier's own
recorded wait is checked against its bound (set to 120 s here) as a hang guard only."""

import os

import pytest

from tests.harness import REPO, Node, free_port, running, wait_listening, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
JOB = os.path.join(REPO, "tests", "e2e", "_end_of_job.py")
BOUND_S = 120


def ids_of(node, ids):
    """The rendezvous ids (``addr_pid_localid``) among ``ids`` that are ``node``'s agent's."""
    return [i for i in ids if f"_{node.pid}_" in i]


def three_nodes(tmp, c_end, c_extra=()):
    """a (hosting the store), b and c; a's and b's workers finish, c's do ``c_end`` once they have
    (``c_extra``: more settings for c)."""
    done = {n: os.path.join(tmp, f"done-{n}") for n in "ab"}
    ep = f"127.0.0.1:{free_port()}"
    extra = ["--set", f"workers.exit_barrier_timeout_s={BOUND_S}", "--set", "rendezvous.keep_alive_interval_s=1",
             "--set", "rendezvous.keep_alive_max_attempts=3", "--set", "workers.restart_backoff_s=0.2"]
    args = ["--steps", "20"]
    nodes = [Node("a", tmp, ep, nnodes="3:3", script=JOB, script_args=[*args, "--done-file", done["a"]], extra=extra)]
    try:
        wait_listening(ep)  # a hosts the store
        nodes.append(Node("b", tmp, ep, nnodes="3:3", script=JOB, script_args=[*args, "--done-file", done["b"]],
                          extra=extra))
        nodes.append(Node("c", tmp, ep, nnodes="3:3", script=JOB, extra=[*extra, *c_extra],
                          script_args=[*args, "--fail-after", f"{done['a']},{done['b']}",
                                       "--fail-flag", os.path.join(tmp, "c-failed"), *c_end]))
    except BaseException:
        for n in nodes:
            n.stop()
        raise
    return nodes


@pytest.mark.parametrize("backoff_s", [0.2, 5.0])
def test_finished_nodes_do_not_wait_for_a_member_that_restarted_and_it_exits_0_not_needed(tmp_path, backoff_s):
    """``backoff_s`` 5: c's restart backoff is longer than the keep-alive window (3 s), during which it is out of
    the rendezvous state (it left to rejoin): a, hosting the store, waits for it all the same (its rejoin
    mark), or c would come back to no store and fail."""
    c_extra = ["--set", f"workers.restart_backoff_s={backoff_s}", "--set", f"workers.restart_backoff_max_s={backoff_s}"]
    with running(three_nodes(str(tmp_path), [], c_extra)) as nodes:
        a, b, c = nodes
        codes = {n.name: n.wait(240) for n in nodes}
        assert codes == {"a": 0, "b": 0, "c": 0}, codes
        assert len(c.events("failing_after_the_others_finished")) == 1

        # c's workers failed after the others' finished: its agent restarted them, leaving the round.
        restarting = [e for e in c.events("state_change") if e["new"] == "restarting"]
        assert restarting[0]["reason"] == "worker_failure" and restarting[0]["backoff_s"] == backoff_s
        assert c.events("left_to_rejoin")
        # a and b each waited for the two others: the other finished, c left; neither waited for c.
        for me, other in ((a, b), (b, a)):
            (line,) = me.events("exit_barrier_done")
            assert line["reason"] in ("members_done", "closed"), line
            assert len(line["waited_for"]) == 2 and ids_of(other, line["finished"]) == line["finished"] != []
            assert ids_of(c, line["left"]) == line["left"] != [], line
            assert line["still_running"] == [] and line["seconds"] < BOUND_S, line
            assert [e["new"] for e in me.events("state_change")][-1] == "succeeded"
        assert a.events("exit_barrier_done")[0]["hosts_store"] and not b.events("exit_barrier_done")[0]["hosts_store"]

        # c, waiting in the next round, learnt from the store that the job is over: exit 0, not needed.
        assert c.events("job_already_complete") and not c.events("supervisor_crashed")
        assert c.events("agent_exit")[-1]["outcome"] == "succeeded"
        assert [e for e in c.events("state_change") if e["new"] == "succeeded"][-1]["reason"] == "not_needed"
        assert not c.events("exit_barrier_done")  # its workers never finished: no barrier

        # a hosts the store: it lingered until b and c had exited (marked it), not one keep-alive longer.
        (linger,) = a.events("store_host_lingered")
        assert linger["reason"] == "all_exited" and ids_of(c, linger["exited"]), linger
        assert linger["still_there"] == [] and linger["seconds"] < BOUND_S
        assert not b.events("store_host_lingered") and not c.events("store_host_lingered")


def test_finished_nodes_wait_for_a_member_that_died_only_until_its_keep_alive_expired(tmp_path):
    """c dies (agent and worker SIGKILLed) after a's and b's workers finished: it never marks itself
    finished nor exited; a and b go once its keep-alive (1 s x 3) expired, and a, the store's host, waits
    for it one keep-alive window more (it could have been between two rounds), not the bound."""
    with running(three_nodes(str(tmp_path), ["--hold"])) as nodes:
        a, b, c = nodes
        wait_until(lambda: c.events("holding_after_the_others_finished"), 180, "c holding after a and b finished")
        c.stop()
        codes = {n.name: n.wait(240) for n in (a, b)}
        assert codes == {"a": 0, "b": 0}, codes
        for me, other in ((a, b), (b, a)):
            (line,) = me.events("exit_barrier_done")
            assert line["reason"] in ("members_done", "closed"), line
            assert ids_of(other, line["finished"]) == line["finished"] != []
            assert ids_of(c, line["left"]) == line["left"] != [] and line["still_running"] == [], line
            assert line["seconds"] < BOUND_S
        (linger,) = a.events("store_host_lingered")
        assert linger["reason"] == "all_exited" and ids_of(c, linger["waited_for"]) and not ids_of(c, linger["exited"])
        assert linger["still_there"] == [] and linger["seconds"] < BOUND_S, linger
