"""A restarted ``trainguard store`` under both rendezvous protocols (issue 40): the running world of two goes on
training and saving, both agents reconnect (keyed: each republishes the round it holds, created once, so one
copy wins and the other finds the same round; dynamic: the first to reconnect republishes its view of the state,
the other reads it, and nobody takes the restarted store's empty key for the job's state), and a third node that
arrives at the restarted store joins a world of three built on the republished round. No committed step is lost or overwritten, epochs only grow.
(``test_checkpoint_epochs.py`` restarts the store under a world of one, then splits the brain.)"""

from __future__ import annotations

import os

import pytest

from tests.e2e.test_checkpoint_epochs import ELASTIC, Store, ckpt_events, claims, committed_refs, worlds
from tests.harness import Node, continued, running, wait_until
from trainguard.checkpoint.discovery import scan_run
from trainguard.checkpoint.storage import Storage

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
ARGS = ["--steps", "100000", "--log-every", "5", "--step-sleep", "0.03", "--global-batch", "24"]


@pytest.mark.parametrize("protocol", ["dynamic", "keyed"])
def test_a_store_restart_loses_no_committed_step_and_the_job_still_grows(tmp_path, protocol):
    tmp = str(tmp_path)
    ckpt = os.path.join(tmp, "ckpt")
    extra = ["--set", f"checkpoint.url={ckpt}", "--set", "checkpoint.interval_steps=5",
             "--set", "checkpoint.keep_last=1000", "--set", "rendezvous.is_host=false",
             "--set", "rendezvous.keep_alive_interval_s=1", "--set", "rendezvous.keep_alive_max_attempts=4"]
    env = {"TRAINGUARD_RENDEZVOUS_PROTOCOL": protocol}
    store = Store(tmp, "s")
    stores = [store]

    def node(name: str) -> Node:
        return Node(name, tmp, store.endpoint, nnodes="1:3", script=ELASTIC, script_args=ARGS, extra=extra, env=env)

    nodes: list[Node] = []
    try:
        with running(nodes) as nodes:
            nodes += [node("a"), node("b")]
            a, b = nodes
            wait_until(lambda: worlds(a)[-1:] == [2] and worlds(b)[-1:] == [2], 150, "world size 2")

            def refs() -> set:
                return committed_refs(a) | committed_refs(b)

            wait_until(lambda: len(refs()) >= 2, 120, "two commits at world size 2")
            rounds_before = (len(worlds(a)), len(worlds(b)))

            store.stop()
            store = Store(tmp, "s-restarted", port=store.port)
            stores.append(store)
            before = refs()

            def reconnected(n: Node) -> bool:
                # dynamic: a node whose state backend reconnects after a peer republished the round reads that
                # round and has nothing to republish (its backend's store_reconnected, the endpoint named)
                return bool(n.events("rendezvous_store_reconnected")) or (
                    protocol == "dynamic" and any("endpoint" in e for e in n.events("store_reconnected")))

            wait_until(lambda: reconnected(a) and reconnected(b), 90, "both agents reconnected to the restarted store")
            if protocol == "dynamic":  # somebody republished the round
                assert [e for n in (a, b) for e in n.events("rendezvous_store_reconnected") if e["published"]]
            wait_until(lambda: len(refs() - before) >= 2, 90, "the world goes on saving after the restart")
            assert (len(worlds(a)), len(worlds(b))) == rounds_before  # no re-formation, no restart
            assert not [e for n in (a, b) for e in n.events("state_change") if e.get("new") == "restarting"]
            if protocol == "keyed":
                ways = sorted(n.events("rendezvous_store_reconnected")[0]["republished"] for n in (a, b))
                assert ways in (["publish", "same"], ["publish", "publish"]), ways  # (publish twice: identical copies)
                assert not [n.name for n in (a, b) for e in n.events("rendezvous_store_reconnected")
                            if e["republished"] == "conflict"]

            # A node that arrives at the restarted store joins: a world of three on the republished round.
            last = max(refs())
            nodes.append(node("c"))
            c = nodes[-1]
            wait_until(lambda: all(worlds(n)[-1:] == [3] for n in (a, b, c)), 150, "world size 3 after the restart")
            wait_until(lambda: any(continued(n, 3) for n in (a, b, c)), 90, "the world of 3 continues")
            # c warmed its workers up first: the running world's worker-API mark, lost with the store, was
            # written again after the reconnect
            assert c.events("joined_running_world"), c.dump()
            cont = next(e for n in (a, b, c) for e in continued(n, 3))
            assert cont["step"] >= last.step, (cont, last)
            wait_until(lambda: any(r.step > cont["step"] for r in committed_refs(a) | committed_refs(b) | committed_refs(c)),
                       90, "a commit by the world of 3")

            everything = refs() | committed_refs(c)
            scan = scan_run(Storage(ckpt), "job")
            assert everything <= set(scan.committed), sorted(everything - set(scan.committed))
            epochs = [e["epoch"] for n in (a, b, c) for e in claims(n)]
            assert len(set(epochs)) == len(set((e["epoch"], e.get("rdzv_round")) for n in (a, b, c) for e in claims(n)))
            assert not [e for n in (a, b, c) for e in ckpt_events(n, "checkpoint_fenced")]
    finally:
        for s in stores:
            s.stop()
