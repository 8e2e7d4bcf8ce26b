"""The elastic global sample cursor: exactly-once data across world-size changes."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainguard.runtime.cursor import ElasticSampler, GlobalSampleCursor
from trainguard.strategies.batch import plan, split

pytestmark = pytest.mark.timeout(60)

B, MICRO = 24, 2  # valid at world sizes 1, 2, 3, 4, 6, 12


def train(n: int, seed: int, drop_last: bool, schedule: list[tuple[int, int]]) -> list[list[int]]:
    """Simulate a job: for each (world_size, steps) segment, every rank restores the cursor from the
    JSON checkpoint of the previous segment, pulls its ids through ElasticSampler, and advances after
    each optimizer step. Returns the global batch of every step (ranks' shares concatenated)."""
    state = GlobalSampleCursor(n, B, seed, drop_last=drop_last).state_dict()
    batches: list[list[int]] = []
    for world, steps in schedule:
        state = json.loads(json.dumps(state))  # checkpoint round trip, at a batch boundary
        cursors = []
        for _ in range(world):
            c = GlobalSampleCursor(n, B, seed, drop_last=drop_last)
            c.load_state_dict(state)
            cursors.append(c)
        samplers = [ElasticSampler(cursors[r], r, world, MICRO) for r in range(world)]
        accum, per_rank = plan(B, world, MICRO)
        its = [iter(s) for s in samplers]
        for _ in range(steps):
            step: list[int] = []
            for r in range(world):
                ids = list(itertools.islice(its[r], per_rank))
                if not ids:  # epoch over for this loader: a new epoch's iteration starts at the cursor
                    its[r] = iter(samplers[r])
                    ids = list(itertools.islice(its[r], per_rank))
                assert len(ids) == per_rank == accum * MICRO
                step += ids
            assert len(step) == B, "global batch must be constant"
            batches.append(step)
            for c in cursors:
                c.advance()
        states = [c.state_dict() for c in cursors]
        assert all(s == states[0] for s in states)
        state = states[0]
    return batches


SCHEDULES = [
    [(2, 9)],
    [(2, 3), (1, 4), (3, 5), (2, 7)],
    [(1, 1), (4, 6), (2, 2), (3, 9)],
    [(3, 4), (3, 4), (1, 1), (6, 5)],
    [(4, 2), (2, 3), (4, 1), (1, 5), (3, 3), (12, 4)],
    [(2, 0), (1, 13)],
]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: "->".join(str(w) for w, _ in s))
@pytest.mark.parametrize("n,drop_last", [(96, True), (96, False), (100, True), (100, False)])
def test_every_sample_once_per_epoch_across_resizes(schedule, n, drop_last):
    seed = 1234
    batches = train(n, seed, drop_last, schedule)
    stream = [i for b in batches for i in b]
    total_steps = sum(s for _, s in schedule)
    # identical to one process at world size 1 with no resumption: world size never changes the data
    ref = GlobalSampleCursor(n, B, seed, drop_last=drop_last)
    assert batches == [ref.next_global_batch() for _ in range(total_steps)]
    per_epoch = (n // B) * B if drop_last else n
    for e in range(len(stream) // per_epoch):
        chunk = stream[e * per_epoch:(e + 1) * per_epoch]
        assert len(set(chunk)) == per_epoch, "a sample repeated within an epoch"
        perm = GlobalSampleCursor(n, B, seed).permutation(e)
        expected = perm[:per_epoch] if drop_last else perm
        assert sorted(chunk) == sorted(expected.tolist())
        if not drop_last or n % B == 0:
            assert sorted(chunk) == list(range(n)), "every sample exactly once per epoch"
    tail = stream[(len(stream) // per_epoch) * per_epoch:]
    assert len(set(tail)) == len(tail)


def test_epochs_differ_and_seed_matters():
    a, b = GlobalSampleCursor(50, 10, seed=1), GlobalSampleCursor(50, 10, seed=2)
    assert a.permutation(0).tolist() != a.permutation(1).tolist()
    assert a.permutation(0).tolist() != b.permutation(0).tolist()
    assert a.permutation(3).tolist() == GlobalSampleCursor(50, 10, seed=1).permutation(3).tolist()


def test_drop_last_rollover_and_wrap_straddle():
    c = GlobalSampleCursor(10, 4, seed=0, drop_last=True)
    c.advance(2)
    assert (c.epoch, c.consumed) == (1, 0)  # the last 2 ids of epoch 0 are dropped
    w = GlobalSampleCursor(10, 4, seed=0, drop_last=False)
    w.advance(2)
    straddle = w.next_global_batch()
    assert straddle == w.permutation(0)[8:].tolist() + w.permutation(1)[:2].tolist()
    assert (w.epoch, w.consumed) == (1, 2)


@pytest.mark.parametrize("gb,world,micro,expected", [
    (24, 1, 2, (12, 24)), (24, 2, 2, (6, 12)), (24, 3, 2, (4, 8)), (24, 4, 2, (3, 6)), (32, 4, 8, (1, 8)),
])
def test_plan(gb, world, micro, expected):
    assert plan(gb, world, micro) == expected


@pytest.mark.parametrize("gb,world,micro,needle", [
    (24, 5, 2, "cannot be split evenly over world size 5"),
    (24, 4, 4, "not a multiple of `micro_batch_size`=4"),
    (24, 0, 2, "`world_size` must be a positive integer"),
    (24, 2, 0, "`micro_batch_size` must be a positive integer"),
])
def test_plan_errors_name_setting_and_fix(gb, world, micro, needle):
    with pytest.raises(ValueError) as ei:
        plan(gb, world, micro)
    msg = str(ei.value)
    assert needle in msg
    if world > 0 and micro > 0:
        assert "Fix:" in msg and "valid world sizes" in msg


def test_sampler_refuses_an_impossible_world_size():
    with pytest.raises(ValueError, match="global_batch_size"):
        ElasticSampler(GlobalSampleCursor(100, 24), rank=0, world_size=5, micro_batch_size=2)


def test_split_micro_batches():
    ids = list(range(12))
    assert split(ids, 1, 2, 3) == [[6, 7, 8], [9, 10, 11]]
    assert [i for r in range(3) for mb in split(ids, r, 3, 2) for i in mb] == ids
    with pytest.raises(ValueError):
        split(ids, 2, 2, 3)


def test_state_dict_is_tiny_json_and_checked():
    c = GlobalSampleCursor(100, 10, seed=7)
    c.advance(3)
    sd = c.state_dict()
    assert json.loads(json.dumps(sd)) == sd and len(json.dumps(sd)) < 200
    for key, val in (("seed", 8), ("dataset_size", 99), ("drop_last", False)):
        with pytest.raises(ValueError, match=f"`{key}`"):
            GlobalSampleCursor(100, 10, seed=7).load_state_dict({**sd, key: val})
    with pytest.raises(ValueError, match="global_batch_size"):
        GlobalSampleCursor(100, 20, seed=7).load_state_dict(sd)
    other = GlobalSampleCursor(100, 20, seed=7)
    other.load_state_dict(sd, allow_global_batch_change=True)
    assert other.consumed == 30
    with pytest.raises(ValueError, match="corrupt"):
        GlobalSampleCursor(100, 10, seed=7).load_state_dict({**sd, "consumed": 101})
    with pytest.raises(ValueError, match="larger than the dataset"):
        GlobalSampleCursor(5, 10)


def test_works_with_dataloader_and_prefetch_does_not_move_the_cursor():
    n = 48
    ds = TensorDataset(torch.arange(n))
    cursor = GlobalSampleCursor(n, 12, seed=3)
    sampler = ElasticSampler(cursor, rank=1, world_size=2, micro_batch_size=3)
    assert len(sampler) == 4 * 6
    loader = DataLoader(ds, batch_size=3, sampler=sampler)
    it = iter(loader)
    got = [next(it)[0].tolist() for _ in range(4)]  # 2 optimizer steps of 2 micro-batches, fetched ahead
    assert cursor.consumed == 0  # fetching is not training
    expected = [mb for _ in range(2) for mb in split(cursor.next_global_batch(), 1, 2, 3)]
    assert got == expected
