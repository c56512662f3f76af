"""Pipeline schedules as pure per-rank action lists (no MPI): coverage, dependencies,
one action per slot, bubble fractions against the published formulas, negative controls."""
import dataclasses
from collections import Counter

import pytest

from commlib.pipeline import Action, bubble_formula, generate, validate

CASES = [(name, d, m) for name in ("gpipe", "1f1b", "interleaved", "chimera")
         for d in (1, 2, 3, 4, 6) for m in (1, 2, 3, 4, 8, 16)
         if not (name == "chimera" and (d % 2 or m < 2))]


@pytest.mark.parametrize("name,d,m", CASES)
def test_schedule_valid(name, d, m):
    sched = generate(name, d, m)
    validate(sched)
    assert len(sched.actions) == d
    # every (pipe, micro, stage) forward and backward exactly once
    seen = Counter((a.kind, a.pipe, a.micro, a.stage) for r in range(d)
                   for a in sched.compute(r))
    assert set(seen.values()) == {1}
    assert len(seen) == 2 * m * sched.stages
    # bubble against the published formula (forward and backward of one slot each)
    bubble, formula = sched.bubble_fraction, bubble_formula(name, d, m)
    if name in ("gpipe", "1f1b") or (name == "chimera" and m % d == 0):
        assert bubble == pytest.approx(formula, abs=1e-12)
    elif name == "interleaved":
        assert formula - 1e-12 <= bubble <= bubble_formula("1f1b", d, m) + 1e-12
    else:  # chimera with M not a multiple of D: still no worse than 1F1B
        assert bubble <= bubble_formula("1f1b", d, m) + 1e-12


@pytest.mark.parametrize("d", [4, 6, 8])
def test_chimera_halves_the_bubbles(d):
    for m in (d, 2 * d, 4 * d):
        chimera, one = generate("chimera", d, m), generate("1f1b", d, m)
        # bubble slots per rank: D-2 instead of 2(D-1)
        assert chimera.makespan - 2 * m == d - 2
        assert one.makespan - 2 * m == 2 * (d - 1)
        assert chimera.bubble_fraction < one.bubble_fraction


def peak_in_flight(sched, rank):
    """Most micro-batches forwarded but not yet backwarded on ``rank`` at once."""
    live = peak = 0
    for a in sched.compute(rank):
        live += 1 if a.kind == "forward" else -1
        peak = max(peak, live)
    return peak


def test_activation_memory():
    d, m = 4, 16
    gpipe, one, chimera = (generate(s, d, m) for s in ("gpipe", "1f1b", "chimera"))
    assert [peak_in_flight(gpipe, r) for r in range(d)] == [m] * d
    assert [peak_in_flight(one, r) for r in range(d)] == [d - r for r in range(d)]
    # Chimera: balanced, D + 1 on every rank at most (stage r and stage D-1-r)
    peaks = [peak_in_flight(chimera, r) for r in range(d)]
    assert max(peaks) <= d + 1 and max(peaks) - min(peaks) <= 1


def test_messages_and_allreduce():
    sched = generate("chimera", 4, 4)
    for r in range(4):
        kinds = Counter(a.kind for a in sched.actions[r])
        assert kinds["allreduce"] == 2 and kinds["sync"] == 1
        assert sched.actions[r][-1].kind == "sync"
        # each allreduce right after the last backward of its stage
        acts = sched.actions[r]
        for i, a in enumerate(acts):
            if a.kind == "allreduce":
                later = [b for b in acts[i:] if b.kind == "backward" and b.stage == a.stage]
                assert not later
    assert sched.replicas(0) == [0, 3] and sched.replicas(1) == [1, 2]


def drop(sched, rank, pred):
    """A copy of ``sched`` without the first action of ``rank`` matching ``pred``."""
    acts = [list(a) for a in sched.actions]
    i = next(i for i, a in enumerate(acts[rank]) if pred(a))
    del acts[rank][i]
    return dataclasses.replace(sched, actions=acts)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "chimera"])
def test_negative_controls(name):
    sched = generate(name, 4, 4)
    validate(sched)
    # one backward dropped
    broken = drop(sched, 0, lambda a: a.kind == "backward")
    with pytest.raises(ValueError, match="missing"):
        validate(broken)
    # two actions in one slot
    acts = [list(a) for a in sched.actions]
    i, j = [k for k, a in enumerate(acts[1]) if a.kind in ("forward", "backward")][:2]
    acts[1][j] = dataclasses.replace(acts[1][j], slot=acts[1][i].slot)
    with pytest.raises(ValueError, match="two actions in one slot"):
        validate(dataclasses.replace(sched, actions=acts))
    # a recv whose send was dropped: deadlock
    broken = drop(sched, 0, lambda a: a.kind == "send")
    with pytest.raises(ValueError, match="deadlock|without its inputs"):
        validate(broken)
    # a send nobody receives
    acts = [list(a) for a in sched.actions]
    acts[0].insert(-1, Action("send", 0, 0, 0, 1, "activation"))
    with pytest.raises(ValueError, match="never received"):
        validate(dataclasses.replace(sched, actions=acts))
    # a dependency broken in the timeline: a backward before its forward's slot
    acts = [list(a) for a in sched.actions]
    k = next(k for k, a in enumerate(acts[0]) if a.kind == "backward")
    acts[0][k] = dataclasses.replace(acts[0][k], slot=0)
    with pytest.raises(ValueError):
        validate(dataclasses.replace(sched, actions=acts))


def test_bad_arguments():
    with pytest.raises(ValueError, match="even"):
        generate("chimera", 3, 4)
    with pytest.raises(ValueError, match="schedule"):
        generate("pipedream", 2, 4)
    with pytest.raises(ValueError, match="micro_batches"):
        generate("1f1b", 2, 0)
