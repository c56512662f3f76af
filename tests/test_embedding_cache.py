"""commlib.EmbeddingCache (HET): eviction order, dirty-only write-back, bounds 0 equal to
the uncached synchronous table, the pull bound on every logged read, and conservation of
the pushed updates after flush() (with a negative control that forgets evicted rows)."""
import pytest

torch = pytest.importorskip("torch")

import commlib  # noqa: E402
from commlib.embedding.cache import eviction_order  # noqa: E402
from test_embedding import F64, TOL, D, N, run  # noqa: E402


def accesses(sequence):
    """(last use tick, use count) per id after reading ``sequence`` (one id per tick)."""
    entries = {}
    for tick, i in enumerate(sequence, 1):
        entries[i] = (tick, entries.get(i, (0, 0))[1] + 1)
    return entries


def test_lru_order():
    assert eviction_order(accesses([5, 3, 9, 5, 7, 3]), "lru") == [9, 5, 7, 3]
    assert eviction_order({4: (1, 9), 2: (1, 1), 8: (0, 5)}, "lru") == [8, 2, 4]


def test_lfu_order():
    assert eviction_order(accesses([5, 3, 9, 5, 7, 3, 3]), "lfu") == [9, 7, 5, 3]
    # ties on count: least recent first, then the smaller id
    assert eviction_order({4: (2, 1), 2: (2, 1), 8: (1, 1), 1: (0, 3)}, "lfu") == [8, 2, 4, 1]


def test_bad_arguments():
    with pytest.raises(ValueError, match="policy"):
        commlib.EmbeddingCache(4, policy="fifo")
    with pytest.raises(ValueError, match="pull_bound"):
        commlib.EmbeddingCache(4, pull_bound=-1)
    with pytest.raises(ValueError, match="capacity_rows"):
        commlib.EmbeddingCache(0)


def test_capacity_and_dirty_only_write_back():
    group = commlib.new_subgroup([commlib.get_rank()])
    cache = commlib.EmbeddingCache(3, policy="lru", pull_bound=5, push_bound=5)
    cache.push_log = []
    emb = commlib.ShardedEmbedding(N, D, group=group, dtype=F64, cache=cache)
    emb(torch.tensor([1, 2])).sum().backward()   # rows 1, 2 dirty
    emb.step()
    assert sorted(cache.grad) == [1, 2] and len(cache.push_log[-1][0]) == 0
    with torch.no_grad():
        emb(torch.tensor([3, 4]))                # clean rows; 1 then 2 are the oldest
    emb.step()
    assert len(cache) <= 3
    pushed = cache.push_log[-1][0].tolist()
    assert pushed == [1]                         # evicted dirty row 1 written back
    with torch.no_grad():
        emb(torch.tensor([5, 6, 7]))
    emb.step()
    assert cache.push_log[-1][0].tolist() == [2]  # 3 and 4 were clean: not pushed
    assert len(cache) == 3
    emb.close()


@pytest.mark.mpi
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_bounds_zero_equal_sync(policy, one_thread_per_rank):
    cache = commlib.EmbeddingCache(6, policy=policy, pull_bound=0, push_bound=0)
    assert run("adagrad", cache=cache) < TOL


def conservation_error(skip_evicted_push=False):
    """Largest violation of the pull bound and of conservation after flush (SGD): the
    table equals initial - lr/n * (sum of everything pushed), and what was pushed equals
    what backward produced, summed over ranks."""
    n = commlib.get_world_size()
    cache = commlib.EmbeddingCache(4, policy="lfu", pull_bound=2, push_bound=1)
    cache.read_log, cache.push_log = [], []
    cache.skip_evicted_push = skip_evicted_push
    produced = []
    result = {}

    def inspect(emb, w0, final):
        for ids, owner, used in cache.read_log:
            assert bool(((owner - used) <= 2).all()) and bool((owner >= used).all())
        pushed = torch.zeros(N, D, dtype=F64)
        for ids, grads in cache.push_log:
            pushed.index_add_(0, ids, grads)
        made = torch.zeros(N, D, dtype=F64)
        for ids, grads in produced:
            made.index_add_(0, ids, grads)
        pushed, made = (commlib.allreduce(t) for t in (pushed, made))
        result["err"] = max((pushed - made).abs().max().item(),
                            (final - (w0 - 0.2 / n * pushed)).abs().max().item())

    original = commlib.embedding.table.ShardTable.accumulate

    def logged(self, ids, grad):
        produced.append((ids.clone(), grad.detach().clone()))
        original(self, ids, grad)

    commlib.embedding.table.ShardTable.accumulate = logged
    try:
        worst = run("sgd", cache=cache, inspect=inspect, steps=6)
    finally:
        commlib.embedding.table.ShardTable.accumulate = original
    return worst, result["err"]


@pytest.mark.mpi
def test_pull_bound_and_conservation(one_thread_per_rank):
    worst, err = conservation_error()
    assert err < TOL
    assert worst > 1e-6  # sanity: the owners' table lags the unpushed updates


@pytest.mark.mpi
def test_conservation_negative_control(one_thread_per_rank):
    _, err = conservation_error(skip_evicted_push=True)
    assert err > 1e-6
