"""A property-style test of the epoch protocol: random interleavings of start/restore, save, a save
that dies between shards and manifest, in-place re-formation, kill and a restore probe, across two
worlds on one ``memory://`` run, checked step by step against a small pure model of the protocol.

The model (this file, written independently of the implementation) keeps claimed epochs with their
bases, committed and half-written steps, and applies the rules: claim = newest + 1; only the newest
epoch writes; garbage collection deletes half-written steps older than a later commit of their
epoch, retention within the newest lineage, branches after ``K`` newer lineage commits. After every
operation the implementation's storage must equal the model's, and the property holds: *no operation
deletes one of the newest ``K`` committed steps of the restore lineage* (committed steps of the newest
lineage are never lost), and a restore gives the newest of them.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field

import pytest
import torch

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.discovery import scan_run
from trainguard.checkpoint.errors import CheckpointError, FencedError
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.state import ModelOptimizerState

pytestmark = pytest.mark.timeout(180)
K = 2
Ref = tuple[int, int]  # (step, epoch)


@dataclass
class Model:
    epochs: dict[int, Ref] = field(default_factory=dict)
    """epoch -> its base (step, epoch); (-1, -1) from scratch."""
    committed: set[Ref] = field(default_factory=set)
    uncommitted: set[Ref] = field(default_factory=set)

    def newest(self) -> int:
        return max(self.epochs, default=0)

    def claim(self, base: Ref | None) -> int:
        e = self.newest() + 1
        self.epochs[e] = base or (-1, -1)
        return e

    def lineage(self, epoch: int, pool: set[Ref]) -> set[Ref]:
        out: set[Ref] = set()
        cutoff = None
        e = epoch
        while True:
            out |= {(s, x) for s, x in pool if x == e and (cutoff is None or s <= cutoff)}
            bs, be = self.epochs.get(e, (-1, -1))
            if be < 0 or bs < 0 or be >= e:
                return out
            cutoff = bs if cutoff is None else min(cutoff, bs)
            e = be

    def restore_epoch(self, pool: set[Ref]) -> int | None:
        for e in sorted(set(self.epochs) | {x for _, x in pool}, reverse=True):
            if self.lineage(e, pool):
                return e
        return None

    def restore_target(self) -> Ref | None:
        e = self.restore_epoch(self.committed)
        return max(self.lineage(e, self.committed)) if e is not None else None

    def gc(self, epoch: int, keep: Ref) -> None:
        if self.newest() > epoch:
            return
        newest_commit: dict[int, int] = {}
        for s, e in self.committed:
            newest_commit[e] = max(newest_commit.get(e, -1), s)
        self.uncommitted = {(s, e) for s, e in self.uncommitted if not newest_commit.get(e, -1) > s or (s, e) == keep}
        line = sorted(self.lineage(epoch, self.committed))
        drop = {r for r in line[:-K] if r != keep}
        for s, e in self.committed - set(line):
            if (s, e) != keep and sum(1 for x in line if x[1] > e) >= K:
                drop.add((s, e))
        self.committed -= drop


@dataclass
class World:
    name: str
    mgr: CheckpointManager | None = None
    epoch: int | None = None
    base: Ref | None = None
    step: int = 0
    fenced: bool = False


class Harness:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.url = f"memory://tg-model-{uuid.uuid4().hex[:8]}"
        self.cfg = CheckpointConfig(url=self.url, keep_last=K, verify=False)
        self.model = Model()
        self.worlds = [World("A"), World("B")]
        self.net = torch.nn.Linear(2, 2)
        self.trace: list[str] = []
        self.before: set[Ref] = set()
        self.fenced_saves = 0

    def state(self) -> dict:
        return {"m": ModelOptimizerState(self.net)}

    def manager(self, w: World) -> CheckpointManager:
        def hook(point: str, step: int) -> None:
            if point == "before_commit" and getattr(w, "crash_next", False):
                raise ConnectionResetError("injected: the save dies between its shards and its manifest")

        return CheckpointManager(self.cfg, "run", rank=0, world_size=1, fault_hook=hook)

    # -- operations, each applied to the implementation and to the model --------------------------

    def start(self, w: World) -> None:
        if w.mgr is not None:
            w.mgr.close()
        w.mgr = self.manager(w)
        target = self.model.restore_target()
        got = w.mgr.restore(self.state())
        assert got == (target[0] if target else None), (got, target)
        w.fenced = False
        if target is None:
            w.epoch, w.base, w.step = None, None, 0
        else:
            w.base, w.step = target, target[0]
            w.epoch = self.model.claim(target)
            assert w.mgr.epoch == w.epoch

    def save(self, w: World, *, crash: bool = False) -> None:
        assert w.mgr is not None
        w.step += 1
        setattr(w, "crash_next", crash)
        if w.epoch is None and not w.fenced:
            w.epoch = self.model.claim(w.base)
        fenced_now = w.fenced or self.model.newest() > (w.epoch or 0)
        try:
            w.mgr.save(w.step, self.state(), block=True)
            outcome = "committed"
        except FencedError:
            outcome = "fenced"
        except CheckpointError:
            outcome = "crashed"
        assert w.mgr.epoch == w.epoch
        if fenced_now:
            assert outcome == "fenced", outcome
            self.fenced_saves += 1
            w.fenced = True
            return
        assert outcome == ("crashed" if crash else "committed"), outcome
        assert w.epoch is not None
        if crash:
            self.model.uncommitted.add((w.step, w.epoch))
            return
        ref = (w.step, w.epoch)
        self.model.committed.add(ref)
        w.base = ref
        self.model.gc(w.epoch, keep=ref)

    def reform(self, w: World) -> None:
        assert w.mgr is not None
        e = w.mgr.new_world(rank=0, world_size=1, rdzv_round=0)
        w.epoch, w.fenced = self.model.claim(w.base), False
        assert e == w.epoch

    def kill(self, w: World) -> None:
        assert w.mgr is not None
        w.mgr.close()
        w.mgr, w.epoch, w.fenced = None, None, False

    def probe(self) -> None:
        """A third world restores and dies before saving (it claims an epoch, fencing the others)."""
        mgr = CheckpointManager(self.cfg, "run", rank=0, world_size=1)
        target = self.model.restore_target()
        assert mgr.restore(self.state()) == (target[0] if target else None)
        if target is not None:
            assert mgr.epoch == self.model.claim(target)
        mgr.close()

    # -- the checks ------------------------------------------------------------------------------

    def check(self) -> None:
        scan = scan_run(self.worlds[0].mgr.storage if self.worlds[0].mgr else CheckpointManager(
            self.cfg, "run", rank=0, world_size=1).storage, "run")
        got_committed = {(r.step, r.epoch) for r in scan.committed}
        got_uncommitted = {(r.step, r.epoch) for r in scan.uncommitted}
        assert got_committed == self.model.committed, ("committed", sorted(got_committed), sorted(self.model.committed))
        assert got_uncommitted == self.model.uncommitted, ("half-written", sorted(got_uncommitted),
                                                          sorted(self.model.uncommitted))
        assert {e: (r.base_step, r.base_epoch) for e, r in scan.epochs.items()} == self.model.epochs
        # The property: no operation deletes any of the newest K steps of the restore lineage, counting
        # every step that existed before the operation or was committed by it.
        pool = self.before | got_committed
        e = self.model.restore_epoch(got_committed)
        if e is not None:
            newest = sorted(self.model.lineage(e, pool))[-K:]
            assert set(newest) <= got_committed, ("lost", newest, sorted(got_committed))
            assert scan.restore_lineage()[-1].step == newest[-1][0]
        self.before = got_committed

    def run(self, ops: int) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _ in range(ops):
            w = self.rng.choice(self.worlds)
            if w.mgr is None:
                op = "start"
            else:
                op = self.rng.choices(["save", "crash", "start", "reform", "kill", "probe"],
                                      weights=[45, 8, 15, 12, 10, 5])[0]
            self.trace.append(f"{w.name}.{op}")
            try:
                actions = {"start": lambda: self.start(w), "save": lambda: self.save(w),
                           "crash": lambda: self.save(w, crash=True), "reform": lambda: self.reform(w),
                           "kill": lambda: self.kill(w), "probe": self.probe}
                actions[op]()
                self.check()
            except AssertionError as e:
                raise AssertionError(f"after {' '.join(self.trace[-30:])}: {e}") from e
            counts[op] = counts.get(op, 0) + 1
        for w in self.worlds:
            if w.mgr is not None:
                w.mgr.close()
        return counts


@pytest.mark.parametrize("seed", range(1, 5))
def test_random_interleavings_never_lose_the_newest_lineage(seed: int) -> None:
    h = Harness(seed)
    counts = h.run(250)
    assert counts.get("save", 0) >= 30 and counts.get("reform", 0) >= 3 and counts.get("crash", 0) >= 3
    assert h.fenced_saves >= 1 and len(h.model.epochs) >= 5  # the worlds really raced each other
