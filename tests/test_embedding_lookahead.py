"""commlib.LookaheadLoader (Bagpipe): the oracle against a brute-force reference on
hand-made and random id sequences, the capacity bound, and training through the loader
equal to synchronous training (1e-10) with a negative control (an oracle that prefetches
rows other batches still update)."""
import random

import pytest

torch = pytest.importorskip("torch")

import test_embedding as te  # noqa: E402
from commlib.embedding import lookahead as la  # noqa: E402


def brute_force(mine, touched, L):
    """Earliest valid fetch step of every (batch, id): scan f upward from b - L."""
    out = {}
    for b, ids in enumerate(mine):
        for i in ids:
            for f in range(max(0, b - L), b + 1):
                if all(i not in touched[c] for c in range(f, b)):
                    out[(b, i)] = f
                    break
    return out


def fetch_steps(decisions):
    return {(b, i): s for s, d in enumerate(decisions) for b, ids in d.items() for i in ids}


HAND = [
    # (this rank's ids per batch, every rank's ids per batch)
    ([{1, 2}, {3}, {1, 4}, {2}, {5}], [{1, 2, 7}, {3, 2}, {1, 4}, {2, 6}, {5, 1}]),
    ([{0}, {0}, {0}, {0}], [{0}, {0}, {0}, {0}]),          # every batch updates row 0
    ([{9}, set(), set(), {9}], [{9}, set(), {8}, {9}]),     # 9 prefetchable at step 1
]


@pytest.mark.parametrize("L", [0, 1, 2, 4])
def test_oracle_matches_brute_force(L):
    cases = list(HAND)
    rng = random.Random(L)
    for _ in range(20):
        steps = rng.randint(1, 9)
        mine = [set(rng.sample(range(12), rng.randint(0, 4))) for _ in range(steps)]
        touched = [m | set(rng.sample(range(12), rng.randint(0, 3))) for m in mine]
        cases.append((mine, touched))
    for mine, touched in cases:
        got = fetch_steps(la.plan(mine, touched, L))
        assert got == brute_force(mine, touched, L), (mine, touched, L)


def test_oracle_hand_decisions():
    mine, touched = HAND[2]
    # row 9: used at 0 and 3; batch 2 does not touch it, batch 0 does: fetched at step 1
    assert la.plan(mine, touched, 2) == [{0: [9]}, {3: [9]}, {}, {}]
    assert la.plan(mine, touched, 1) == [{0: [9]}, {}, {3: [9]}, {}]
    assert la.plan(*HAND[1], 3) == [{0: [0]}, {1: [0]}, {2: [0]}, {3: [0]}]


@pytest.mark.parametrize("capacity", [2, 3, 5])
def test_capacity_bound(capacity):
    rng = random.Random(capacity)
    for _ in range(20):
        steps = rng.randint(2, 9)
        mine = [set(rng.sample(range(15), rng.randint(0, 2))) for _ in range(steps)]
        touched = [m | set(rng.sample(range(15), rng.randint(0, 3))) for m in mine]
        decisions = la.plan(mine, touched, 3, capacity)
        got = fetch_steps(decisions)
        assert set(got) == {(b, i) for b, ids in enumerate(mine) for i in ids}
        earliest = brute_force(mine, touched, 3)
        for (b, i), f in got.items():
            assert earliest[(b, i)] <= f <= b  # valid: nothing updates it in [f, b-1]
            assert all(i not in touched[c] for c in range(f, b))
        for s in range(steps):  # rows held after step s's fetch: fetched, not yet used
            held = sum(1 for (b, _), f in got.items() if f <= s <= b)
            assert held <= capacity
    with pytest.raises(ValueError, match="capacity"):
        la.plan([{1, 2, 3}], [{1, 2, 3}], 1, capacity=2)


@pytest.mark.mpi
@pytest.mark.parametrize("L,capacity", [(1, None), (3, None), (3, 12)])
def test_lookahead_equals_sync(L, capacity, one_thread_per_rank, monkeypatch):
    monkeypatch.setattr(te, "lookahead_capacity", capacity)
    assert te.run("adagrad", lookahead=L, steps=7) < te.TOL


@pytest.mark.mpi
def test_lookahead_with_adam_equals_sync(one_thread_per_rank, monkeypatch):
    """Both halves of a split update take the bias correction of their own batch."""
    monkeypatch.setattr(te, "lookahead_capacity", None)
    assert te.run("adam", lookahead=2, steps=7) < te.TOL


@pytest.mark.mpi
def test_lookahead_negative_control(one_thread_per_rank, monkeypatch):
    def eager(step, mine, touched, fetched, held, lookahead, capacity):
        # prefetches every row of the window at once, ignoring updates in between
        return {b: sorted(i for i in mine.get(b, ()) if (b, i) not in fetched)
                for b in range(step, step + lookahead + 1) if mine.get(b)}
    monkeypatch.setattr(la, "decide", eager)
    assert te.run("adagrad", lookahead=3, steps=7) > 1e-6
