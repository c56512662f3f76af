"""``commlib.elastic`` pieces that need no failure (1 rank, in the pytest process, cheap):
the sampler's re-sharding, the state's commits and user values, a newcomer's error
feedback, and what elastic training refuses (algorithms whose state cannot survive a
death, ZeRO where untested), each refused with an error naming it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import commlib
from commlib import elastic
from commlib.elastic.state import POLICIES, UNSUPPORTED


@settings(max_examples=60, deadline=None)
@given(length=st.integers(1, 300), batch=st.integers(1, 64), seed=st.integers(0, 9),
       shuffle=st.booleans(), sizes=st.lists(st.integers(1, 7), min_size=1, max_size=4),
       shrink_at=st.integers(0, 40))
def test_sampler_reshards_without_repeating_or_skipping(length, batch, seed, shuffle,
                                                        sizes, shrink_at):
    """Whatever the group sizes a job goes through (a shrink at step ``shrink_at`` each),
    every step's shards over the ranks are disjoint and together exactly that step's global
    batch, which depends on the step alone; every epoch reads each sample at most once."""
    if batch > length:
        with pytest.raises(ValueError, match="batch_size"):
            elastic.ElasticSampler(length, batch)
        return
    sampler = elastic.ElasticSampler(length, batch, shuffle=shuffle, seed=seed)
    fixed = elastic.ElasticSampler(length, batch, shuffle=shuffle, seed=seed)
    steps = 3 * sampler.steps_per_epoch
    seen: dict[int, list[int]] = {}
    for step in range(steps):
        size = sizes[min(len(sizes) - 1, step // max(1, shrink_at))] if shrink_at else sizes[-1]
        shards = [sampler.indices(step, r, size) for r in range(size)]
        joined = [i for s in shards for i in s]
        case = f"length={length} batch={batch} step={step} size={size}"
        assert joined == fixed.global_batch(step).tolist(), case
        assert len(set(joined)) == batch, case
        assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1, case
        seen.setdefault(sampler.epoch_of(step), []).extend(joined)
    for epoch, idx in seen.items():
        assert len(idx) == len(set(idx)), f"epoch {epoch} read a sample twice"
    # a new order each epoch: epoch 0's samples in order against epoch 1's (at least 8 of
    # them: two random orders of 8 agree with probability 1/40320; one batch of one
    # sample, as this test once compared, agrees 1 time in `length`)
    spe = sampler.steps_per_epoch
    if shuffle and spe * batch >= 8:
        def epoch(e):
            return np.concatenate([sampler.global_batch(e * spe + s) for s in range(spe)])
        assert not np.array_equal(epoch(0), epoch(1))


def test_sampler_iterates_from_the_states_step():
    sampler = elastic.ElasticSampler(40, 8, seed=1)
    with pytest.raises(RuntimeError, match="sampler of a commlib.elastic.State"):
        next(iter(sampler))
    state = elastic.State(None, None, sampler)
    state.__dict__["group"] = commlib.world()
    state.commit(), state.commit()
    batches = list(sampler)
    assert len(batches) == sampler.steps_per_epoch - 2
    rank, size = commlib.get_rank(), commlib.get_world_size()
    assert batches[0] == sampler.indices(2, rank, size)  # this rank's share of step 2
    if size == 1:
        assert batches[0] == sampler.global_batch(2).tolist()  # 1 rank: the whole batch


def test_state_values_and_commits():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = elastic.State(model, optimizer, epoch=4, commit_every=2)
    assert state.epoch == 4 and state.step == 0 and state.last_commit == 0
    state.epoch = 5
    assert state.values == {"epoch": 5}
    with pytest.raises(AttributeError, match="nothing"):
        state.nothing
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state.commit()
    assert state.step == 1 and state.last_commit == 0
    assert state._value() == (0, False)  # moved past the commit, which kept no copy
    optimizer.step()
    state.commit()
    assert state.last_commit == 2 and state._value() == (2, True)
    assert torch.equal(state._commits[-1].model["weight"], model.weight.detach())
    assert state._commits[-1].values == {"epoch": 5}
    for bad in ({"commit_every": 0}, {"keep": 1}):
        with pytest.raises(ValueError, match="commit_every"):
            elastic.State(model, optimizer, **bad)


def test_replicated_state_is_not_copied():
    """commit_every=1 with gradient_allreduce: every survivor holds the last commit
    already, nothing is copied."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = elastic.State(model, optimizer)
    ddp = state.wrap()
    try:
        ddp(torch.ones(2, 3)).sum().backward()
        optimizer.step()
        state.commit()
        assert state._value() == (1, True) and not state._commits[-1].full
        optimizer.step()  # a step without commit: the live state is no commit any more
        assert state._value() == (1, False)
    finally:
        state.close_wrapper()


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_algorithms_are_refused(name):
    state = elastic.State(torch.nn.Linear(3, 2))
    with pytest.raises(commlib.CommError, match=f"algorithm '{name}' is not supported"):
        state.wrap(algorithm=name)


def test_every_algorithm_is_either_supported_or_refused():
    from commlib.algorithms import available
    missing = set(available()) - set(POLICIES) - set(UNSUPPORTED)
    assert not missing, f"algorithms unknown to commlib.elastic: {sorted(missing)}"


def test_zero_is_refused_where_untested():
    """ZeRO (its shards replicated on the next rank, commlib.elastic.zero) with the
    gradients averaged by state.wrap(); refused with reduce_gradients=True and behind an
    algorithm that does not average gradients."""
    model = torch.nn.Linear(3, 2)
    with commlib.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                         lr=0.1, reduce_gradients=True) as optimizer:
        with pytest.raises(commlib.CommError, match="reduce_gradients=True is not supported"):
            elastic.State(model, optimizer)
    with commlib.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                         lr=0.1) as optimizer:
        state = elastic.State(model, optimizer)
        with pytest.raises(commlib.CommError, match="needs averaged gradients"):
            state.wrap(algorithm="local_sgd")
        with pytest.raises(commlib.CommError, match="not supported with a "
                                                    "ZeroRedundancyOptimizer"):
            elastic.run(lambda st: None, state, replace=True)


def test_fsdp_and_sharded_embeddings_are_refused():
    bag = commlib.ShardedEmbeddingBag(10, 4)
    with pytest.raises(commlib.CommError, match="ShardedEmbeddingBag is not supported: a "
                                                "shard of its parameters dies"):
        elastic.State(torch.nn.Sequential(bag, torch.nn.Linear(4, 2)))
    fsdp = commlib.FullyShardedDataParallel(torch.nn.Linear(3, 2), "FULL_SHARD")
    with pytest.raises(commlib.CommError, match="FullyShardedDataParallel is not supported"):
        elastic.State(fsdp)
    elastic.State(torch.nn.Linear(3, 2))  # (a plain model is not)


OWN_STATE = {"sparseloco": ({"sync_every": 1, "chunk_size": 4, "density": 0.25}, "_error"),
             "muloco": ({"sync_every": 1}, "_residual"),
             "demo": ({"chunk_size": 2, "topk": 1}, "_momentum")}


@pytest.mark.parametrize("name", sorted(OWN_STATE))
def test_a_newcomer_starts_without_the_error_feedback(name):
    """A rank that takes another rank's state (a joining spare, a replacement: ``_adopted``)
    keeps the model and the shared algorithm state but starts with zero error feedback;
    a survivor that restores its own keeps it."""
    kwargs, attr = OWN_STATE[name]

    def own(algorithm):
        value = getattr(algorithm, attr)
        values = value.values() if isinstance(value, dict) else value
        return sum(float(v.abs().sum()) for v in values)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = elastic.State(model, optimizer)
    ddp = state.wrap(algorithm=name, **kwargs)
    try:
        for _ in range(3):
            ddp(torch.randn(5, 6)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            state.commit()
        ddp(torch.randn(5, 6)).sum().backward()  # (runs the pending outer step, if any)
        optimizer.zero_grad()
        assert own(ddp.algorithm) > 0
        state.__dict__["_algorithm_state"] = ddp.algorithm.state_dict()
        kept = state.wrap(algorithm=name, **kwargs)
        assert own(kept.algorithm) == own(ddp.algorithm) > 0
        state.__dict__["_adopted"] = True
        fresh = state.wrap(algorithm=name, **kwargs)
        assert own(fresh.algorithm) == 0 and not state._adopted
        if name != "demo":  # the global weights are every rank's, they stay
            assert all(torch.equal(a, b) for a, b in zip(fresh.algorithm._global,
                                                         ddp.algorithm._global))
    finally:
        state.close_wrapper()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("keep", [2, 4])
@pytest.mark.parametrize("fenced", [True, False])
def test_per_rank_commits_stay_within_keep(keep, fenced, monkeypatch):
    """decentralized's replicas (per-rank commits) are held within ``keep - 1`` commits of
    each other, so the survivors of a death always share a commit: with rank 0 slow (25 ms
    before each commit), no other rank finishes commit ``c`` before rank 0 started commit
    ``c - keep + 1`` (monotonic clock, one machine). Negative control: without the fence
    the fast ranks run away (all their commits before rank 0's second)."""
    import time

    from commlib.elastic.state import PER_RANK
    if not fenced:
        monkeypatch.setattr(elastic.State, "_fence_due", lambda self: False)
    state = elastic.State(torch.nn.Linear(4, 2), keep=keep)
    state.__dict__["policy"] = PER_RANK     # what wrap(algorithm="decentralized") sets
    rank, commits = commlib.get_rank(), 10
    before, after = np.zeros(commits), np.zeros(commits)
    commlib.barrier()
    for c in range(commits):
        if rank == 0:
            time.sleep(0.025)
        before[c] = time.monotonic()
        state.commit()
        after[c] = time.monotonic()
    state._settle()
    befores = commlib.allgather(before)
    befores = np.asarray(befores).reshape(-1, commits)
    late = [(c + 1, after[c] - befores[0][c - keep + 1]) for c in range(keep - 1, commits)
            if after[c] < befores[0][c - keep + 1]]
    if rank == 0:
        assert not late
    elif fenced:
        assert not late, f"rank {rank}: commits (c, s early) before rank 0's c-{keep - 1}: {late}"
    else:
        assert len(late) >= commits - keep, late
    commlib.barrier()


@pytest.mark.parametrize("policy", ["replicated", "synced"])
def test_a_refill_is_due_at_a_commit_once_the_pool_is_short(policy):
    """``run(refill=True)``: a recovery that leaves the pool of spares short marks the
    refill due; ``commit`` then raises ``RefillDue`` (which ``run`` catches) where the live
    state is the commit just taken (every ``commit_every``-th step), or one step after it
    for the algorithms whose commits are taken at the next step's average; never while the
    pool is full or without ``refill``."""
    from commlib.elastic import refill
    from commlib.elastic.policies import REPLICATED, SYNCED
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = elastic.State(model, optimizer, commit_every=2)
    state.__dict__["policy"] = SYNCED if policy == "synced" else REPLICATED
    state.__dict__.update(_refill=True, spare_target=1, spares=[5])
    refill.mark_due(state)  # the pool is full
    assert not refill.due(state)
    state.__dict__["spares"] = []
    state.__dict__["_refill"] = False
    refill.mark_due(state)  # no refill asked for
    assert not refill.due(state)
    state.__dict__["_refill"] = True
    refill.mark_due(state)
    assert refill.due(state)  # (at step 0, the initial commit)
    optimizer.step()
    if policy == "synced":  # one step after the commit of step 0: due
        with pytest.raises(refill.RefillDue):
            state.commit()
        return
    state.commit()  # step 1: no commit (commit_every=2), the live state moved past it
    assert state.step == 1
    optimizer.step()
    with pytest.raises(refill.RefillDue):
        state.commit()  # step 2: committed, then due
    assert state.last_commit == 2


def test_refill_needs_spares_and_spawning(monkeypatch):
    """``refill=True`` without ``spares`` is a ValueError naming both; where the MPI cannot
    spawn, a CommError naming why (before anything trains)."""
    from commlib.elastic import refill
    state = elastic.State(torch.nn.Linear(3, 2), None)
    with pytest.raises(ValueError, match="refill=True needs spares > 0"):
        elastic.run(lambda s: None, state, refill=True)
    monkeypatch.setattr(refill, "refusal", lambda: "its spawn crashes")
    with pytest.raises(commlib.CommError, match="which this MPI cannot: its spawn crashes"):
        elastic.run(lambda s: None, state, spares=1, refill=True)


def test_no_spawning_in_a_world_formed_from_a_store(monkeypatch):
    """A world formed from a store (no mpiexec) cannot spawn: ``refill`` and
    ``replace=True`` are refused with that reason, whatever the MPI library could do."""
    from commlib.elastic import refill
    from commlib.mpi import launch
    from commlib.primitives import ft
    assert ft.spawn_refusal() == ft.backend().impl.spawn_refusal  # (mpiexec or singleton)
    monkeypatch.setattr(launch, "current", lambda: object())
    assert "without mpiexec" in ft.spawn_refusal() and refill.refusal() == ft.spawn_refusal()
