"""In-place re-formation, the worker's side: what counts as a vanished peer, a void step, the arrival
count every rank of a new world passes, a join called off, parking without waiting for an upload, the
agent link's waits and SIGTERM while a worker waits for a world (the agent's side:
tests/agent/test_reform_units.py)."""

import contextlib

import pytest

from trainguard.contract import protocol as proto
from trainguard.runtime.reform import is_peer_failure
from trainguard.runtime.state import WorkerState
from tests.harness import short_tmp  # noqa: F401 - a fixture


@pytest.mark.parametrize("err,peer", [
    (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:45475"), True),
    (RuntimeError("Read error [127.0.0.1]:42391: Connection reset by peer"), True),
    (RuntimeError("Timed out waiting 30000ms for recv operation to complete"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)"), False),
    (ValueError("Connection closed by peer"), False),
])
def test_what_counts_as_a_vanished_peer(err, peer):
    assert is_peer_failure(err) is peer


@pytest.fixture
def reform_rt(tmp_path, monkeypatch):
    """A set-up one-rank Runtime re-forming in place (as under an agent with workers.reform:
    in-process); SIGTERM's handler and TORCHINDUCTOR_CACHE_DIR (setup() may set it) restored after."""
    import signal

    import torch

    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.runtime.runtime import Runtime

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        rt = Runtime(rank=0, world_size=1, local_rank=0, job_id="run", rdzv_round=0, checkpoint=CheckpointConfig())
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rt.setup(model, opt, dataset_size=32, global_batch=4, micro_batch=2, seed=1)
        rt.reform_enabled = True
        yield rt
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_void_step_swallows_later_peer_failures_and_nothing_else(reform_rt):
    """Once a vanished peer made the step void (a failed background save, a failed collective), the
    rest of the step still runs the script's forward, and DDP's forward broadcasts buffers: that
    failure must be swallowed too (the step is rolled back), any other error must not."""
    rt = reform_rt
    rt.worker_state = WorkerState.BROKEN  # the step is void already: a peer vanished
    with rt.accumulating(last=True):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:24775")
    with pytest.raises(ValueError), rt.accumulating(last=True):
        raise ValueError("a bug in the script")


@pytest.mark.parametrize("peer_finished", [True, False])
def test_a_step_a_survivor_finished_counts_on_the_rank_whose_step_failed(reform_rt, monkeypatch, peer_finished):
    """A peer dies mid all-reduce: one survivor's collective completed (its optimizer step ran),
    another's failed (it rolled back). The new world takes the newest live state, so the step
    counted for the job; end_step must say so on both, or the script would log the step as void
    and the job's sample accounting would miss a step that was trained (chaos case sigkill_node)."""
    rt = reform_rt
    rt.step = 7
    parked: list[proto.ParkReason] = []

    def park(reason: proto.ParkReason) -> None:  # the new world: the newest live state wins
        parked.append(reason)
        if peer_finished:
            rt.step = 8

    monkeypatch.setattr(rt._reform, "park", park)
    rt.worker_state = WorkerState.BROKEN  # a peer vanished mid-step
    rt._stepped = False  # this rank's optimizer step did not run
    assert rt.end_step() is peer_finished
    assert parked == [proto.ParkReason.PEER_LOST] and rt.step == (8 if peer_finished else 7)


# ---- the arrival count before a world's process group (reform.arrive) ---------------------------

def _arrive_each(port, ranks):
    """``ranks``: rank -> (seconds before arriving, aborted callable); each from its own thread."""
    import threading
    import time

    from trainguard.runtime.reform import arrive

    out = {}

    def one(rank, delay, aborted):
        time.sleep(delay)
        try:
            out[rank] = arrive(rank=rank, world_size=len(ranks), master_addr="127.0.0.1", master_port=port,
                               timeout_s=20, aborted=aborted)
        except Exception as e:  # noqa: BLE001 - the test reads it
            out[rank] = e

    threads = [threading.Thread(target=one, args=(r, d, a)) for r, (d, a) in ranks.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_every_rank_arrives_before_any_goes_on():
    from tests.harness import free_port
    from trainguard.runtime.reform import ARRIVED_KEY

    out = _arrive_each(free_port(), {r: (0.0, lambda: False) for r in range(3)})
    assert all(not isinstance(v, Exception) for v in out.values()), out
    assert out[0].add(ARRIVED_KEY, 0) == 3


@pytest.mark.parametrize("rank", [0, 1], ids=["the store's host", "a rank whose host never came"])
def test_a_join_called_off_returns_alive(rank):
    """The world loses a member before it forms: the waiting worker is back within a poll (the
    process group's own wait would last workers.pg_timeout_s)."""
    import time

    from tests.harness import free_port
    from trainguard.runtime.reform import JoinAborted, arrive

    t0 = time.monotonic()
    with pytest.raises(JoinAborted, match="called the world off"):
        arrive(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=free_port(), timeout_s=600,
               aborted=lambda: time.monotonic() - t0 > 0.3)
    assert time.monotonic() - t0 < 5


def test_a_rank_called_off_after_it_arrived_calls_the_world_off_for_every_rank():
    """Chaos `sigterm_agent @ rendezvous`: rank 2 arrived, then its agent drained and called its join
    off; rank 1 arrived after that and made the count full. Before the agreement the others went on to
    init_process_group and waited there for rank 2 until their agents restarted them (from storage)."""
    import threading

    from tests.harness import free_port
    from trainguard.runtime.reform import JoinAborted

    off = threading.Event()
    threading.Timer(0.5, off.set).start()  # rank 2's agent calls it off 0.5 s in; rank 1 arrives at 1.0 s
    out = _arrive_each(free_port(), {0: (0.0, lambda: False), 1: (1.0, lambda: False), 2: (0.1, off.is_set)})
    assert all(isinstance(v, JoinAborted) for v in out.values()), out
    assert "another rank called the world off" in str(out[1])


def test_a_rank_before_the_stores_host_makes_no_client_until_the_store_listens(monkeypatch):
    """A rank that arrives before rank 0's store is up does not meet torch's connect backoff (its
    first sleep is 0.25-0.75 s): it makes its TCPStore client only once the port accepts."""
    import time

    import torch.distributed as dist

    from tests.harness import free_port

    real, made = dist.TCPStore, []

    def recording(*args, is_master=False, **kw):
        made.append(("master" if is_master else "client", time.monotonic()))  # when each was started
        return real(*args, is_master=is_master, **kw)

    monkeypatch.setattr(dist, "TCPStore", recording)
    out = _arrive_each(free_port(), {0: (0.4, lambda: False), 1: (0.0, lambda: False)})
    assert all(not isinstance(v, Exception) for v in out.values()), out
    (first, t_master), (second, t_client) = made  # one client, started once the store's host had started
    assert (first, second) == ("master", "client") and t_client >= t_master, made


def test_a_world_that_never_fills_runs_out_at_the_timeout():
    from tests.harness import free_port
    from trainguard.runtime.reform import arrive

    with pytest.raises(TimeoutError, match="workers.pg_timeout_s"):
        arrive(rank=0, world_size=2, master_addr="127.0.0.1", master_port=free_port(), timeout_s=0.5)


def test_a_join_the_agent_calls_off_leaves_the_worker_as_it_was(reform_rt, monkeypatch):
    """Reformation.join_world: called off (the agent's Stop arrived) -> False, rank, world and groups
    untouched; a world that forms -> True, a process group made through the arrival count."""
    import torch.distributed as dist

    from tests.harness import free_port

    rt = reform_rt
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE"):  # init_world sets torch elastic's env
        monkeypatch.setenv(var, "")

    class Link:
        request = proto.StopReason.RESIZE
        joined: list[proto.Joined] = []

        def report(self, msg):
            self.joined.append(msg)

    rt._session.link = Link()
    msg = proto.Reform(rank=1, world_size=2, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
                       master_port=free_port(), round=5, group_rank=1, nodes=2)
    assert rt._reform.join_world(msg) is False
    assert (rt.rank, rt.world_size, rt.round) == (0, 1, 0) and not dist.is_initialized()
    Link.request = proto.StopReason.NONE
    msg = proto.Reform(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
                       master_port=free_port(), round=6, group_rank=0, nodes=1)
    try:
        assert rt._reform.join_world(msg) is True
        assert dist.is_initialized() and dist.get_world_size() == 1 and rt.round == 6
        assert Link.joined == [proto.Joined(rank=0, local_rank=0, round=6)]  # only the world it joined
    finally:
        from trainguard.runtime.reform import teardown_world

        teardown_world(rt.device, peer_lost=False)


@pytest.mark.parametrize("reason", [proto.ParkReason.PEER_LOST, proto.ParkReason.RESIZE])
def test_a_worker_that_lost_a_peer_parks_without_waiting_for_its_upload(tmp_path, monkeypatch, reason):
    """A survivor whose background save is uploading when a peer dies: that save can never commit, so
    the worker gives it up and parks (reports Parked) at once, instead of finishing a slow upload while
    its agent's member-lost grace runs out and restarts the world from storage (chaos cases
    `aws_notice @ restore`). A planned park (resize) lets the save finish and commit, but reports
    Parked first: its agent joins the re-formation while the save persists (chaos `drain @ rendezvous`:
    rank 0 reported 5 s late, after a slow commit, its peer was already in the next round, and its agent
    restarted the world as a member lost)."""
    import threading

    import torch

    from trainguard.checkpoint import storage as storage_mod
    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.runtime.runtime import Runtime

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    url = str(tmp_path / "ckpt")
    rt = Runtime(rank=0, world_size=1, local_rank=0, job_id="run", rdzv_round=0,
                 checkpoint=CheckpointConfig(url=url, interval_steps=1000))
    model = torch.nn.Linear(4, 1)
    rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset_size=32, global_batch=4, micro_batch=2, seed=1)
    rt.reform_enabled = True
    entered, release = threading.Event(), threading.Event()
    write = storage_mod._DigestWriter.write

    def held(w, b):  # the background thread's first write is a slow upload call: held until released
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            assert release.wait(30)
        return write(w, b)

    monkeypatch.setattr(storage_mod._DigestWriter, "write", held)
    rt.step = 5
    rt._tiers.save(proto.CheckpointKind.PERIODIC.value)
    assert entered.wait(30)  # the upload is under way (held)
    reports: list[tuple[object, bool]] = []

    def committed() -> list[str]:
        return sorted(p.parent.name[:17] for p in (tmp_path / "ckpt" / "run").glob("step-*/manifest.json"))

    class Link:
        request = proto.StopReason.NONE

        def report(self, msg):
            reports.append((msg, release.is_set()))

        def wait_reform(self, timeout_s, abort=None):
            raise SystemExit("parked")  # stop here: what follows (the new world) is not under test

    rt._session.link = Link()
    threading.Timer(0.3, release.set).start()  # the upload call in progress returns
    with pytest.raises(SystemExit, match="parked"):
        rt._reform.park(reason)
    assert [type(m).__name__ for m, _ in reports] == ["Parked"]
    assert reports[0][1] is False  # reported while the upload was still held
    if reason is proto.ParkReason.PEER_LOST:
        assert committed() == []  # given up: nothing of step 5 was committed
    else:
        assert committed() == ["step-000000000005"]  # and the planned park's save committed all the same


@contextlib.contextmanager
def _linked(folder):  # noqa: ANN001, ANN202 - yields (the worker's AgentLink, the agent's end of the socket)
    """A worker's real :class:`AgentLink` connected to a bare socket standing in for the agent."""
    import os
    import socket

    from trainguard.runtime.link import AgentLink

    path = os.path.join(folder, "agent.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    link = AgentLink(path, rank=0, local_rank=0, pid=os.getpid())
    conn, _ = srv.accept()
    try:
        yield link, conn
    finally:
        link.close()
        conn.close()
        srv.close()


def test_a_stop_order_after_the_new_world_stays_pending(short_tmp):  # noqa: F811 - the fixture
    """The agent sends the new world (Reform) and, 18 ms later, a drain (its node got SIGTERM while
    the world formed). The worker takes the world after both arrived: the drain must still be pending
    for the new world's first step boundary (chaos `sigterm_agent @ rendezvous`: it was cleared with
    the resize that led to the park, and the node sat out its whole 30 s drain deadline)."""
    import time

    with _linked(short_tmp) as (link, conn):
        conn.sendall(proto.encode(proto.Stop(proto.StopReason.RESIZE, None, "scale_up")))
        deadline = time.monotonic() + 10
        while link.request is not proto.StopReason.RESIZE and time.monotonic() < deadline:
            time.sleep(0.01)
        world = proto.Reform(rank=0, world_size=3, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
                             master_port=29500, round=30, group_rank=0, nodes=3)
        conn.sendall(proto.encode(world) + proto.encode(proto.Stop(proto.StopReason.DRAIN, time.time() + 30, "stop")))
        while link.request is not proto.StopReason.DRAIN and time.monotonic() < deadline:
            time.sleep(0.01)
        assert link.wait_reform(5) == world
        assert link.request is proto.StopReason.DRAIN and link.deadline is not None


@pytest.mark.parametrize("where", ["parked", "standby"])
def test_sigterm_ends_a_wait_for_a_world_at_once(tmp_path, monkeypatch, where):
    """A worker parked after a lost peer (or in standby before its first world) when its node drains:
    the agent leaves the rendezvous and stops its workers with SIGTERM. No world will come, so the worker
    exits at once; it used to sit in the wait until the agent's stop timeout SIGKILLed it 30 s later
    (whole-trace replay: the last agent's drain took 30.2 s and its final scrape was lost)."""
    import signal
    import threading
    import time

    import torch
    from structlog.testing import capture_logs

    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.runtime.runtime import Runtime

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    rt = Runtime(rank=0, world_size=1, local_rank=0, job_id="run", rdzv_round=0,
                 checkpoint=CheckpointConfig(url=str(tmp_path / "ckpt"), interval_steps=1000), reform_timeout_s=3.0)
    model = torch.nn.Linear(4, 1)
    rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset_size=32, global_batch=4, micro_batch=2, seed=1)
    rt.reform_enabled = True
    waits: list[float] = []

    class Link:  # the agent never sends a world; the wait polls abort() as AgentLink.wait_reform does
        request = proto.StopReason.NONE

        def report(self, msg):
            pass

        def wait_reform(self, timeout_s, abort=None):
            t0 = time.monotonic()
            while time.monotonic() - t0 < timeout_s:
                if abort is not None and abort():
                    break
                time.sleep(0.01)
            waits.append(time.monotonic() - t0)
            return None

        def close(self):
            pass

    def exit_(code):
        raise SystemExit(code)

    rt._session.link = Link()
    monkeypatch.setattr(rt, "_exit", exit_)
    threading.Timer(0.2, rt._session.on_sigterm, args=(signal.SIGTERM, None)).start()  # the agent stops its workers
    with capture_logs() as logs, pytest.raises(SystemExit) as ended:
        if where == "parked":
            rt._reform.park(proto.ParkReason.PEER_LOST)
        else:
            rt.worker_state = WorkerState.STANDBY
            rt._reform.wait_for_first_world()
    assert ended.value.code == proto.EXIT_RESIZE
    events = [e["event"] for e in logs]
    assert "worker_stopped_waiting" in events and "reform_failed" not in events and "standby_timeout" not in events
    assert len(waits) == 1 and waits[0] < 2.0  # not the 3 s reform timeout


def test_the_link_wait_for_a_world_ends_when_aborted(short_tmp):  # noqa: F811 - the fixture
    import threading
    import time

    with _linked(short_tmp) as (link, conn):
        t0 = time.monotonic()
        stop = threading.Event()
        threading.Timer(0.3, stop.set).start()
        assert link.wait_reform(30, abort=stop.is_set) is None
        assert time.monotonic() - t0 < 5  # within a poll slice of the abort, not the 30 s timeout
        world = proto.Reform(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
                             master_port=29500, round=1, group_rank=0, nodes=1)
        conn.sendall(proto.encode(world))
        assert link.wait_reform(5, abort=lambda: False) == world  # a world still arrives when not aborted


@pytest.mark.parametrize("role", ["source", "receiver", "agreed"])
def test_a_loss_the_world_survived_is_counted_once_whichever_rank_sent_the_state(reform_rt, monkeypatch, role):
    """Node c vanished: b re-formed alone first (it counted the loss), then a joined it and took b's
    newer state by broadcast, b's interval stats with it. a must not count c's loss again (it did
    before: a said 2 losses, b 1). A source parked for the loss sends its stats with the loss counted,
    so a receiver parked for the same loss ends with the source's count; a world that agreed counts
    the loss on each rank."""
    from trainguard.runtime import reform as rf

    rt = reform_rt
    if rt._tiers.interval is None:
        rt._tiers.interval = rt._tiers.make_interval()
    rt._tiers.interval.stats.survived_losses = 3  # losses this rank had counted before
    sent: list[dict] = []

    def sync(step, tensors, *, extra, load_extra, group=None, tensor_group=None):
        extra = extra() if callable(extra) else extra  # made on the source rank only
        sent.append(extra)
        if role == "receiver":  # b's state: c's loss already counted there (4 in all)
            load_extra({**extra, "interval": {**extra["interval"], "survived_losses": 4, "survived_failures": 1}})
            return "broadcast", step + 10
        return ("broadcast" if role == "source" else "agreed"), step

    monkeypatch.setattr(rf, "sync_live_state", sync)
    outcome, _ = rt._reform.resume_state(proto.ParkReason.PEER_LOST)
    assert outcome == ("agreed" if role == "agreed" else "broadcast")
    assert rt._tiers.interval.stats.survived_losses == 4, role
    assert rt._tiers.interval.stats.survived_failures == 1, role
    if role == "source":  # what the receivers take is what the source holds after the sync
        assert sent[0]["interval"]["survived_losses"] == 4 and sent[0]["interval"]["survived_failures"] == 1
    # A re-formation to grow counts no loss, and sends none.
    sent.clear()
    role = "source"
    rt._reform.resume_state(proto.ParkReason.RESIZE)
    assert rt._tiers.interval.stats.survived_losses == 4 and sent[0]["interval"]["survived_losses"] == 4
