"""The end of a job on one node: an exit barrier that waits only for the members still in the round, and
the linger of an agent that hosts the c10d store. Values, pure decisions and the wait loops; no torch.

Why not torch elastic's own barrier (``SimpleElasticAgent``'s, ``store_util.barrier`` with ``world_size`` =
the round's node count): it waits for *every* member of the round the node last joined.
A member that left the round near the end (its workers restarted after a failure or a hang, the node
left to rejoin warm, was quarantined, drained or evicted, or died) never arrives, so a node whose
workers finished waited out ``workers.exit_barrier_timeout_s`` (300 s) for it - and that member, waiting
in the next round for a job that is over, waited as long.

What a finished node does instead (:meth:`trainguard.agent.elastic.ElasticAdapter.exit_barrier` runs
:func:`wait_for_members` over the round's store):

1. it marks itself finished in the store of the round it last joined (:data:`FINISHED_KEY`);
2. every :data:`POLL_S` it reads the shared rendezvous state (synced: a member whose keep-alive
   expired is no participant any more, torch's own rule; one evicted on evidence neither) and the
   marks of the members it still waits for, and :func:`decide_exit` says whether to go on waiting.
   It waits for the members of its round that are still participants and have not finished; it stops
   once there are none, or the rendezvous is closed (a node ended the job), or the state is at another
   round (the round this node finished in is over), or this node is no participant any more, or after
   ``workers.exit_barrier_timeout_s``, or once the store has not answered for the keep-alive window
   (the round's state is gone with it: nobody can wait for this node);
3. one ``exit_barrier_done`` line says whom it waited for, who finished, who left, why it stopped and
   how long it took.

What torch's barrier is also for stays: a node does not exit while a member still runs its workers
(a rank-0-only evaluation after the last step keeps the others waiting, within the bound). And an agent
that hosts the c10d store (``rendezvous.is_host``, or torch's rule when it is unset) must not take the
store away while other nodes still need it: after closing the rendezvous it lingers
(:func:`wait_for_exits`, :func:`decide_linger`) until every other node the rendezvous state knows
(participants, waiting and redundant nodes with a current keep-alive) has marked itself exited
(:data:`EXITED_KEY`, written by every agent as it closes the rendezvous) or lost its keep-alive, within
the same bound; one ``store_host_lingered`` line. The members its exit barrier saw leave count too: one
that left to rejoin warm (:data:`REJOINING_KEY`) until it exited, within the bound (it is out of the
rendezvous state for its backoff and its new workers' start-up, and would find no store when it comes
back; while it warms up it looks for the closed rendezvous every second); any other for one keep-alive
window. A node that only reaches the store after the host exited cannot be helped: that is why spot
clusters run ``trainguard store`` on a node of its own.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from trainguard.contract.log import get_logger

log = get_logger("trainguard.agent.exitbarrier")

POLL_S = 0.25
"""How often a node in the exit barrier (or a host lingering) reads the rendezvous state and the marks."""

FINISHED_KEY = "trainguard/exit_barrier/finished/"
"""Under the round's store prefix, + the node's rendezvous id: its workers finished in that round."""

EXITED_KEY = "trainguard/exit_barrier/exited/"
"""Under the job's exit prefix (:func:`trainguard.agent.elastic.ElasticAdapter.close`), + the node's
rendezvous id: the agent closed the rendezvous and is about to exit (it needs the store no more)."""

REJOINING_KEY = "trainguard/exit_barrier/rejoining/"
"""Under the job's exit prefix, + the node's rendezvous id: ``1`` while the node, having left its round to
come back warm (:meth:`trainguard.agent.elastic.ElasticAdapter.leave` with ``rejoin``), is out of the
rendezvous state for its backoff and its new workers' start-up and will need the store again; ``0`` once
it joined a round again or left for good."""


class ExitReason(str, Enum):
    """Why a node stopped waiting in the exit barrier (the ``reason`` of ``exit_barrier_done``)."""

    MEMBERS_DONE = "members_done"
    """Every other member of the round finished or left it."""
    CLOSED = "closed"
    """The rendezvous is closed: a node ended the job."""
    ROUND_MOVED_ON = "round_moved_on"
    """The shared state is at another round: the round this node finished in is over."""
    LEFT_ROUND = "left_round"
    """This node is no participant any more (its keep-alive lapsed, or it was evicted)."""
    STORE_UNREACHABLE = "store_unreachable"
    """The store did not answer for the keep-alive window."""
    TIMED_OUT = "timed_out"
    """``workers.exit_barrier_timeout_s`` passed with members still running."""


class LingerReason(str, Enum):
    """Why a store-hosting agent stopped lingering (the ``reason`` of ``store_host_lingered``)."""

    ALL_EXITED = "all_exited"
    """Every other node the rendezvous knew marked itself exited or lost its keep-alive."""
    STORE_UNREACHABLE = "store_unreachable"
    TIMED_OUT = "timed_out"


@dataclass(frozen=True, slots=True)
class RoundView:
    """One read of the shared rendezvous state (synced and sanitized: expired keep-alives dropped)."""

    round: int
    closed: bool
    participants: frozenset[str]
    """Rendezvous ids of the current round's participants."""
    known: frozenset[str] = frozenset()
    """Rendezvous ids of every node with a current keep-alive (participants, waiting, redundant)."""


@dataclass(frozen=True, slots=True)
class ExitVerdict:
    """What :func:`decide_exit` says: stop waiting (``done``) or not, and about whom."""

    done: bool
    reason: ExitReason | None
    waiting_for: frozenset[str]
    """Members still in the round that have not finished (empty once ``done`` unless timed out)."""
    left: frozenset[str]
    """Members of the round that left it without finishing."""


def decide_exit(me: str, round_: int, members: frozenset[str], finished: frozenset[str], view: RoundView | None,
                elapsed_s: float, timeout_s: float, unreachable_s: float | None,
                unreachable_limit_s: float) -> ExitVerdict:
    """Pure: whether node ``me``, whose workers finished in round ``round_`` of ``members``, stops waiting.

    ``finished``: the members seen marked finished; ``view``: the last read of the rendezvous state (None
    when the last read failed); ``unreachable_s``: how long the store has not answered (None: it
    answered last time). See the module docstring for the rules; tests/agent/test_exitbarrier.py has the
    table."""
    others = members - {me}
    if view is None:
        pending = others - finished
        if unreachable_s is not None and unreachable_s >= unreachable_limit_s:
            return ExitVerdict(True, ExitReason.STORE_UNREACHABLE, pending, frozenset())
        if elapsed_s >= timeout_s:
            return ExitVerdict(True, ExitReason.TIMED_OUT, pending, frozenset())
        return ExitVerdict(False, None, pending, frozenset())
    left = others - finished - view.participants
    pending = (others & view.participants) - finished
    if view.closed:
        return ExitVerdict(True, ExitReason.CLOSED, frozenset(), left)
    if view.round != round_:
        return ExitVerdict(True, ExitReason.ROUND_MOVED_ON, frozenset(), left)
    if me not in view.participants:
        return ExitVerdict(True, ExitReason.LEFT_ROUND, frozenset(), left)
    if not pending:
        return ExitVerdict(True, ExitReason.MEMBERS_DONE, frozenset(), left)
    if elapsed_s >= timeout_s:
        return ExitVerdict(True, ExitReason.TIMED_OUT, pending, left)
    return ExitVerdict(False, None, pending, left)


@dataclass(frozen=True, slots=True)
class LingerVerdict:
    done: bool
    reason: LingerReason | None
    waiting_for: frozenset[str]


def decide_linger(me: str, known: frozenset[str] | None, exited: frozenset[str], elapsed_s: float, timeout_s: float,
                  unreachable_s: float | None, unreachable_limit_s: float, left: frozenset[str] = frozenset(),
                  grace_s: float = 0.0, rejoining: frozenset[str] = frozenset()) -> LingerVerdict:
    """Pure: whether the agent ``me`` that hosts the store may exit: every other node with a current
    keep-alive (``known``; None when the last read failed) marked itself ``exited``, and so did every
    member of its last round that ``left`` it without finishing: for ``grace_s`` (one keep-alive window:
    such a node may be between leaving the round and joining the next one, and holds no keep-alive
    meanwhile; one that died never comes back), or, when it said it is ``rejoining``, until the bound."""
    if known is None:
        if unreachable_s is not None and unreachable_s >= unreachable_limit_s:
            return LingerVerdict(True, LingerReason.STORE_UNREACHABLE, frozenset())
        return LingerVerdict(elapsed_s >= timeout_s, LingerReason.TIMED_OUT if elapsed_s >= timeout_s else None,
                             frozenset())
    pending = (known | (left & rejoining) | (left if elapsed_s < grace_s else frozenset())) - {me} - exited
    if not pending:
        return LingerVerdict(True, LingerReason.ALL_EXITED, frozenset())
    if elapsed_s >= timeout_s:
        return LingerVerdict(True, LingerReason.TIMED_OUT, pending)
    return LingerVerdict(False, None, pending)


# ---- the loops (I/O through callables: the adapter passes its store and state reads) -------------

@dataclass(frozen=True, slots=True)
class ExitOutcome:
    """How the exit barrier ended (also logged as ``exit_barrier_done``)."""

    reason: ExitReason
    round: int
    waited_for: tuple[str, ...]
    """The other members of the round (whom this node waited for)."""
    finished: tuple[str, ...]
    left: tuple[str, ...]
    pending: tuple[str, ...]
    """Members still running when it stopped (only on a time-out or an unreachable store)."""
    seconds: float


def _unreachable(since: float | None, now: float) -> float | None:
    return None if since is None else now - since


def wait_for_members(me: str, round_: int, members: frozenset[str], *, mark_finished: Callable[[], None],
                     read: Callable[[], RoundView], finished: Callable[[frozenset[str]], frozenset[str]],
                     timeout_s: float, unreachable_limit_s: float, poll_s: float = POLL_S,
                     clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                     hosts_store: bool = False) -> ExitOutcome:
    """The exit barrier of node ``me`` (its workers finished in round ``round_`` of ``members``): mark,
    then poll (``read`` the rendezvous state, ask ``finished`` about the members not seen finished yet)
    until :func:`decide_exit` says stop. Store errors are retried (an unreachable store ends it after
    ``unreachable_limit_s``). Logs one ``exit_barrier_done`` line."""
    t0 = clock()
    seen: frozenset[str] = frozenset()
    down_since: float | None = None
    try:
        mark_finished()
    except Exception as e:  # noqa: BLE001 - the others then see this node leave instead of finish
        down_since = t0
        log.warning("exit_barrier_mark_failed", error=f"{type(e).__name__}: {e}"[:200])
    while True:
        now = clock()
        view: RoundView | None
        try:
            view = read()
            unseen = members - {me} - seen  # also those gone since: they finished, they did not leave
            if unseen:
                seen |= finished(frozenset(unseen))
            down_since = None
        except Exception as e:  # noqa: BLE001 - a store that restarts or went with its host
            if down_since is None:
                down_since = now
                log.info("exit_barrier_read_failed", error=f"{type(e).__name__}: {e}"[:200])
            view = None
        verdict = decide_exit(me, round_, members, seen, view, clock() - t0, timeout_s,
                              _unreachable(down_since, clock()), unreachable_limit_s)
        if verdict.done:
            assert verdict.reason is not None
            out = ExitOutcome(verdict.reason, round_, tuple(sorted(members - {me})), tuple(sorted(seen)),
                              tuple(sorted(verdict.left)), tuple(sorted(verdict.waiting_for)),
                              round(clock() - t0, 3))
            barrier_fields = {"node_id": me, "round": round_, "reason": out.reason.value,
                              "waited_for": list(out.waited_for), "finished": list(out.finished),
                              "left": list(out.left), "still_running": list(out.pending), "seconds": out.seconds,
                              "timeout_s": timeout_s, "hosts_store": hosts_store}
            if out.reason in (ExitReason.TIMED_OUT, ExitReason.STORE_UNREACHABLE):
                log.warning("exit_barrier_done", **barrier_fields)
            else:
                log.info("exit_barrier_done", **barrier_fields)
            return out
        sleep(poll_s)


@dataclass(frozen=True, slots=True)
class LingerOutcome:
    reason: LingerReason
    waited_for: tuple[str, ...]
    exited: tuple[str, ...]
    pending: tuple[str, ...]
    seconds: float


def wait_for_exits(me: str, *, read: Callable[[], RoundView], exited: Callable[[frozenset[str]], frozenset[str]],
                   timeout_s: float, unreachable_limit_s: float, left: frozenset[str] = frozenset(),
                   rejoining: Callable[[frozenset[str]], frozenset[str]] = lambda nodes: frozenset(),
                   poll_s: float = POLL_S, clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep) -> LingerOutcome:
    """The linger of the agent ``me`` that hosts the store, after it closed the rendezvous: until every
    other node with a current keep-alive, and every member of its last round that ``left`` it (those
    ``rejoining`` says came back warm, within the bound; the others for one keep-alive window,
    ``unreachable_limit_s``), marked itself exited (:func:`decide_linger`). Logs one
    ``store_host_lingered`` line."""
    t0 = clock()
    seen: frozenset[str] = frozenset()
    ever: frozenset[str] = frozenset()
    back: frozenset[str] = frozenset()
    down_since: float | None = None
    while True:
        now = clock()
        known: frozenset[str] | None
        try:
            known = read().known
            ever |= known - {me}
            pending = (known | left) - {me} - seen
            if pending:
                seen |= exited(frozenset(pending))
            if left - back - seen:
                back |= rejoining(frozenset(left - back - seen))
            down_since = None
        except Exception:  # noqa: BLE001 - this process hosts the store: only its own end breaks it
            known = None
            down_since = now if down_since is None else down_since
        verdict = decide_linger(me, known, seen, clock() - t0, timeout_s, _unreachable(down_since, clock()),
                                unreachable_limit_s, left, unreachable_limit_s, back)
        if verdict.done:
            assert verdict.reason is not None
            out = LingerOutcome(verdict.reason, tuple(sorted(ever | (left - {me}))), tuple(sorted(seen)),
                                tuple(sorted(verdict.waiting_for)), round(clock() - t0, 3))
            linger_fields = {"node_id": me, "reason": out.reason.value, "waited_for": list(out.waited_for),
                             "exited": list(out.exited), "still_there": list(out.pending), "seconds": out.seconds,
                             "timeout_s": timeout_s, "effect": "the store this agent hosts goes with it now"}
            if out.reason is LingerReason.ALL_EXITED:
                log.info("store_host_lingered", **linger_fields)
            else:
                log.warning("store_host_lingered", **linger_fields)
            return out
        sleep(poll_s)


# ---- whether this process hosts the store ---------------------------------------------------------

def listening_inodes(tcp_tables: list[str], port: int) -> set[str]:
    """Pure: the socket inodes listening (state ``0A``) on ``port`` in ``/proc/net/tcp``-format tables."""
    found = set()
    for table in tcp_tables:
        for line in table.splitlines()[1:]:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A":
                continue
            try:
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    found.add(fields[9])
            except (IndexError, ValueError):
                continue
    return found


def listens_here(port: int, proc: str = "/proc/self") -> bool:
    """Whether this process holds a socket listening on TCP ``port`` (Linux ``/proc``; False elsewhere):
    how an agent knows it hosts the c10d store (torch hosts it in-process when ``is_host`` is true, or
    unset and the endpoint is this machine and the port was free, and keeps no flag of it)."""
    tables = []
    for name in ("tcp", "tcp6"):
        try:
            with open(os.path.join(proc, "net", name)) as fh:
                tables.append(fh.read())
        except OSError:
            continue
    inodes = listening_inodes(tables, port)
    if not inodes:
        return False
    try:
        fds = os.listdir(os.path.join(proc, "fd"))
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(os.path.join(proc, "fd", fd))
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return True
    return False


__all__ = ["EXITED_KEY", "FINISHED_KEY", "POLL_S", "REJOINING_KEY", "ExitOutcome", "ExitReason", "ExitVerdict",
           "LingerOutcome", "LingerReason", "LingerVerdict", "RoundView", "decide_exit", "decide_linger",
           "listening_inodes", "listens_here", "wait_for_exits", "wait_for_members"]
