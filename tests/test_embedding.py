"""commlib.ShardedEmbeddingBag / ShardedEmbedding against torch's sparse embeddings.

1 rank: bit-identical to ``nn.EmbeddingBag(sparse=True)`` / ``nn.Embedding(sparse=True)``
trained with torch's optimizer on the per-row (coalesced) gradient. n ranks: the sharded
table under ``commlib.DistributedDataParallel`` equals one process training on the
concatenated global batch (1e-10, float64), every step, on every rank; with
``staleness=tau`` it equals a single-process reference that applies each batch's update
just before batch ``b + tau + 1`` is read. A negative control (owners drop the rows other
ranks send) must be rejected by the same checker.
"""
import copy
from collections import deque

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import commlib  # noqa: E402
from commlib.embedding import LookaheadLoader, PrefetchLoader  # noqa: E402

F64 = torch.float64
N, D, CLASSES = 23, 3, 3
TOL = 1e-10


def world():
    return commlib.get_rank(), commlib.get_world_size()


def coalesced_step(opt, param):
    """torch's optimizer on the per-row summed gradient (the row-wise rule)."""
    param.grad = param.grad.coalesce()
    opt.step()


def torch_optimizer(name, params, lr):
    return {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad,
            "adam": torch.optim.SparseAdam}[name](params, lr=lr)


# -- 1 rank: bit-identical ----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["bag_sum_offsets", "bag_mean", "embedding"])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_one_rank_bit_identical(kind, optimizer):
    group = commlib.new_subgroup([commlib.get_rank()])  # one rank, whatever the world
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(N, D, dtype=F64, generator=gen)
    if kind == "embedding":
        ref = torch.nn.Embedding(N, D, sparse=True, _weight=w0.clone(), dtype=F64)
        emb = commlib.ShardedEmbedding(N, D, group=group, optimizer=optimizer, lr=0.3,
                                       dtype=F64, _weight=w0)
    else:
        mode = "sum" if kind == "bag_sum_offsets" else "mean"
        ref = torch.nn.EmbeddingBag(N, D, mode=mode, sparse=True, _weight=w0.clone(),
                                    dtype=F64)
        emb = commlib.ShardedEmbeddingBag(N, D, mode=mode, group=group, optimizer=optimizer,
                                          lr=0.3, dtype=F64, _weight=w0)
    ropt = torch_optimizer(optimizer, ref.parameters(), 0.3)
    for step in range(6):
        ids = torch.randint(0, 8, (12,), generator=gen)  # many repeats
        target = torch.randn(4, dtype=F64, generator=gen)
        if kind == "bag_sum_offsets":
            args = (ids, torch.tensor([0, 2, 2, 7]),
                    torch.rand(12, dtype=F64, generator=gen))
        else:
            args = (ids.reshape(4, 3),)
        outs = []
        ref.weight.grad = None
        for module in (ref, emb):
            out = module(*args)
            loss = (out.sum(-1).reshape(4, -1).mean(-1) - target).pow(2).mean()
            loss.backward()
            outs.append(out.detach())
        coalesced_step(ropt, ref.weight)
        assert torch.equal(outs[0], outs[1]), f"step {step}: forward differs"
        assert torch.equal(emb.state_dict()["weight"], ref.weight.detach()), \
            f"step {step}: table differs"
        assert torch.equal(emb.local_weight, ref.weight.detach())
    emb.close()
    group.free()


def test_bad_input():
    with pytest.raises(ValueError, match="mode"):
        commlib.ShardedEmbeddingBag(N, D, mode="min")
    with pytest.raises(ValueError, match="optimizer"):
        commlib.ShardedEmbeddingBag(N, D, optimizer="lamb")
    with pytest.raises(ValueError, match="num_embeddings"):
        commlib.ShardedEmbedding(0, D)


@pytest.mark.mpi
def test_bad_ids_every_rank():
    emb = commlib.ShardedEmbedding(N, D, dtype=F64)
    with pytest.raises(ValueError, match=r"rank \d+.*'input'.*outside"):
        emb(torch.tensor([0, N]))
    with pytest.raises(TypeError, match="'input'"):
        emb(torch.tensor([0.5]))
    emb.close()


# -- n ranks under DDP ----------------------------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self, emb):
        super().__init__()
        self.emb = emb
        gen = torch.Generator().manual_seed(7)
        self.mlp = torch.nn.Linear(D, CLASSES, dtype=F64)
        with torch.no_grad():
            self.mlp.weight.copy_(torch.randn(CLASSES, D, dtype=F64, generator=gen))
            self.mlp.bias.zero_()

    def forward(self, ids):
        return self.mlp(torch.tanh(self.emb(ids)))


def global_batch(step, n, per_rank=3, bag=4):
    gen = torch.Generator().manual_seed(100 + step)
    # skewed ids: many rows are hit by several ranks in one step
    ids = (torch.rand(n * per_rank, bag, generator=gen) ** 3 * N).long()
    y = torch.randint(0, CLASSES, (n * per_rank,), generator=gen)
    return ids, y


def drop_remote(table, ids, grads, recv_splits):
    """Negative control: an owner applies only its own rows' gradients."""
    start = sum(recv_splits[:table.rank])
    keep = slice(start, start + recv_splits[table.rank])
    return ids[keep], grads[keep]


lookahead_capacity = None


def run(optimizer="adagrad", tau=0, prefetch=False, control=False, steps=6, per_rank=3,
        cache=None, inspect=None, lookahead=None):
    """Train the sharded model (DDP dense part) and the single-process reference; return
    the largest difference seen (tables and dense parameters, every step)."""
    rank, n = world()
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(N, D, dtype=F64, generator=gen)
    emb = commlib.ShardedEmbeddingBag(N, D, mode="mean", optimizer=optimizer, lr=0.2,
                                      staleness=tau, dtype=F64, _weight=w0, cache=cache)
    emb.table.read_log = []
    if control:
        emb.table.apply_filter = drop_remote
    ddp = commlib.DistributedDataParallel(Net(emb))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    assert not any(p is emb.local_weight for p in ddp.parameters())
    assert all(not name.startswith("emb") for name, _ in ddp._ctx.named_parameters)

    ref = Net(torch.nn.EmbeddingBag(N, D, mode="mean", sparse=True, _weight=w0.clone(),
                                    dtype=F64))
    ref_dense = torch.optim.SGD(ref.mlp.parameters(), lr=0.1)
    ref_emb = torch_optimizer(optimizer, ref.emb.parameters(), 0.2)
    queue = deque()
    batches = [global_batch(s, n, per_rank) for s in range(steps)]
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    local = [(ids[mine], y[mine]) for ids, y in batches]
    loader = PrefetchLoader(local, [emb], lambda b: [b[0]]) if prefetch else local
    if lookahead is not None:
        loader = LookaheadLoader(local, [emb], lambda b: [b[0]], lookahead=lookahead,
                                 capacity=lookahead_capacity)
        emb.table.read_log = None
    worst = 0.0
    try:
        for step, (ids, y) in enumerate(loader):
            opt.zero_grad()
            F.cross_entropy(ddp(ids), y).backward()
            opt.step()  # its post hook closes the embedding batch
            t = emb.table
            # the invariant: a read for batch j saw exactly max(0, j - tau) updates
            for rec in t.read_log or ():
                assert rec["applied"] == max(0, rec["batch"] - tau), rec
            assert t.closed == step + 1
            assert t.closed - t.applied <= (tau + 1 if tau else 0)
            # the reference on the whole batch, its embedding updates delayed by tau
            while len(queue) > tau:
                ref.emb.weight.grad = queue.popleft()
                coalesced_step(ref_emb, ref.emb.weight)
            gids, gy = batches[step]
            ref_dense.zero_grad()
            ref.emb.weight.grad = None
            F.cross_entropy(ref(gids), gy).backward()
            ref_dense.step()
            queue.append(ref.emb.weight.grad.coalesce())
            # compare what batch `step` saw: the table state after the same updates
            mine_full = emb.table.full()  # collective; reflects t.applied batches
            expect = _reference_table(ref, ref_emb, queue, t.applied, step, tau)
            if lookahead is None:  # with lookahead the owners may lag ("later" gradients)
                worst = max(worst, (mine_full - expect).abs().max().item())
            for a, b in zip(ddp.module.mlp.parameters(), ref.mlp.parameters()):
                worst = max(worst, (a - b).abs().max().item())
            flat = torch.cat([p.detach().reshape(-1) for p in ddp.module.mlp.parameters()])
            everyone = commlib.allgather(flat)
            for other in everyone:  # dense parameters identical on every rank
                assert torch.equal(other, flat)
        emb.flush()
        while queue:
            ref.emb.weight.grad = queue.popleft()
            coalesced_step(ref_emb, ref.emb.weight)
        final = emb.state_dict()["weight"]
        worst = max(worst, (final - ref.emb.weight.detach()).abs().max().item())
        if inspect is not None:
            inspect(emb, w0, final)
    finally:
        emb.close()
        del ddp
    return worst


def _reference_table(ref, ref_emb, queue, applied, step, tau):
    """The reference table after ``applied`` batches (the reference has applied
    ``step + 1 - len(queue)``; apply the missing ones on a copy)."""
    done = step + 1 - len(queue)
    table = ref.emb.weight.detach().clone()
    extra = applied - done
    if extra <= 0:
        assert extra == 0, (applied, done)
        return table
    param = torch.nn.Parameter(table)
    opt = type(ref_emb)([param], **{k: v for k, v in ref_emb.defaults.items()
                                    if k in ("lr", "eps", "betas")})
    opt.load_state_dict(copy.deepcopy(ref_emb.state_dict()))  # else it shares the sums
    for grad in list(queue)[:extra]:
        param.grad = grad
        opt.step()
    return param.detach()


@pytest.mark.mpi
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_sync_equals_global_batch(optimizer, one_thread_per_rank):
    assert run(optimizer) < TOL


@pytest.mark.mpi
def test_negative_control_rejected(one_thread_per_rank):
    if commlib.get_world_size() == 1:
        pytest.skip("no remote rows at 1 rank")
    assert run("sgd", control=True) > 1e-6


@pytest.mark.mpi
@pytest.mark.parametrize("tau,prefetch", [(1, True), (2, True), (4, True), (2, False)])
def test_staleness(tau, prefetch, one_thread_per_rank):
    assert run("adagrad", tau=tau, prefetch=prefetch, steps=7) < TOL


@pytest.mark.mpi
def test_staleness_with_adam_counts_the_batch_not_the_moment(one_thread_per_rank):
    """A delayed update of batch k takes Adam's bias correction of step k, as the
    reference's delayed SparseAdam step does."""
    assert run("adam", tau=2, prefetch=True, steps=7) < TOL


@pytest.mark.mpi
def test_staleness_negative_control(one_thread_per_rank):
    if commlib.get_world_size() == 1:
        pytest.skip("no remote rows at 1 rank")
    assert run("sgd", tau=2, prefetch=True, control=True, steps=7) > 1e-6


@pytest.mark.mpi
def test_state_dict_moves_between_world_sizes():
    rank, n = world()
    full = torch.arange(N * D, dtype=F64).reshape(N, D)
    emb = commlib.ShardedEmbeddingBag(N, D, dtype=F64)
    emb.load_state_dict({"weight": full})
    assert torch.equal(emb.local_weight, full[rank::n])
    assert torch.equal(emb.state_dict()["weight"], full)
    # a 1-rank table built from this one's state holds the same rows
    solo = commlib.ShardedEmbeddingBag(N, D, dtype=F64,
                                       group=commlib.new_subgroup([commlib.get_rank()]))
    solo.load_state_dict(emb.state_dict())
    assert torch.equal(solo.local_weight, full)
    with pytest.raises(RuntimeError, match="size mismatch"):
        emb.load_state_dict({"weight": full[:-1]})
    emb.close()
    solo.close()


def _train(emb, steps, start):
    """Train ``emb`` alone (sum of its bags as the loss) on seeded per-rank batches
    ``start .. start + steps - 1``."""
    rank = commlib.get_rank()
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(0, N, (4, 3), generator=gen)
        target = torch.randn(4, D, dtype=F64, generator=gen)
        (emb(ids) - target).pow(2).sum().backward()
        emb.step()


@pytest.mark.mpi
@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_optimizer_state_resumes_exactly_and_reshards(optimizer):
    w0 = torch.randn(N, D, dtype=F64, generator=torch.Generator().manual_seed(5))

    def fresh(group=None):
        return commlib.ShardedEmbeddingBag(N, D, mode="sum", optimizer=optimizer, lr=0.05,
                                           dtype=F64, _weight=w0, group=group)
    whole = fresh()
    _train(whole, 3, 0)
    weights, state = whole.state_dict(), whole.optimizer_state_dict()
    assert state["step"] == 3 and state["optimizer"] == optimizer
    _train(whole, 3, 3)
    expect = whole.state_dict()["weight"]

    resumed, forgetful = fresh(), fresh()
    resumed.load_state_dict(weights)
    resumed.load_optimizer_state_dict(state)
    forgetful.load_state_dict(weights)  # negative control: the optimizer starts over
    for emb in (resumed, forgetful):
        _train(emb, 3, 3)
    assert torch.equal(resumed.state_dict()["weight"], expect)
    assert not torch.equal(forgetful.state_dict()["weight"], expect)

    # another world size: a 1-rank table holds the same whole state
    solo = fresh(group=commlib.new_subgroup([commlib.get_rank()]))
    solo.load_optimizer_state_dict(state)
    again = solo.optimizer_state_dict()
    assert again["step"] == 3
    for key, full in state["state"].items():
        assert torch.equal(again["state"][key], full)
    with pytest.raises(ValueError, match="optimizer state is for 'sgd'"):
        resumed.load_optimizer_state_dict(dict(state, optimizer="sgd"))
    with pytest.raises(ValueError, match="shape"):
        resumed.load_optimizer_state_dict(
            dict(state, state={k: v[:-1] for k, v in state["state"].items()}))
    for emb in (whole, resumed, forgetful, solo):
        emb.close()
