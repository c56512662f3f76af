"""Horovod's ``test_sparse_embeddings`` shape (``torch.optim.SparseAdam`` over
``nn.Embedding(10, 3, sparse=True)`` in ``hvd.DistributedOptimizer``, with and without
``sparse_as_dense``), several steps, float64, measured on every rank:

* the parameters after every step equal (rtol 1e-10, atol 1e-12) the same SparseAdam
  training in one process over the global batch (the mean of every rank's loss, each
  rank's batch rebuilt locally from its seed), with backward_passes_per_step 1 and 2;
* the gradient the wrapped optimizer receives is the one Horovod 0.28.1 hands it, rebuilt
  on each rank from every rank's batch: without ``sparse_as_dense`` the uncoalesced
  concatenation of every rank's (uncoalesced) indices and values, in rank order, the
  values divided by the world size (``gradient_predivide_factor`` ignored), bit for bit;
  with it ``mean(dense gradients).to_sparse()`` (coalesced, 2 sparse dims); at one rank
  Horovod registers no hooks and hands the local gradient untouched.

Negative controls: the same comparisons reject an optimizer that skips the exchange
(bare SparseAdam on each rank's own batch, at 2+ ranks), one fed the densified gradient
(hvd.DistributedOptimizer over torch.optim.Adam on a dense embedding), each rank's
gradient coalesced before the allgather, and the other mode's format.
Also ``sparse_allreduce_async``'s layout and its TypeError on a dense tensor.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import commlib.horovod as hvd  # noqa: E402

pytestmark = pytest.mark.mpi
STEPS = 5
LR = 0.1
ROWS, DIM = 10, 3


@pytest.fixture(scope="module", autouse=True)
def horovod(one_thread_per_rank):
    hvd.init()
    yield
    hvd.shutdown()


def make_model(sparse: bool = True) -> nn.Module:
    torch.manual_seed(7)
    return nn.Embedding(ROWS, DIM, sparse=sparse).double()


def batch(rank: int, step: int, micro: int) -> tuple:
    """Rank ``rank``'s indices and targets: Horovod's test input at the first pass, then
    random rows that repeat within a batch and across ranks; odd steps draw from rows 0-5
    only, so rows seen before get no gradient there (SparseAdam leaves them, Adam not)."""
    g = torch.Generator().manual_seed(100 + 1000 * rank + 10 * step + micro)
    if step == 0 and micro == 0:
        x = torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9]] if rank == 0 else [[1, 3, 4], [4, 7, 9]])
    else:
        x = torch.randint(0, 6 if step % 2 else ROWS, (2, 3 + rank % 2), generator=g)
    return x, torch.randn(*x.shape, DIM, generator=g, dtype=torch.float64)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).sum()


class Recording(torch.optim.SparseAdam):
    """SparseAdam that keeps a copy of the gradient each step() receives."""

    def step(self, closure=None):
        grad = self.param_groups[0]["params"][0].grad
        self.__dict__.setdefault("handed", []).append(grad.clone())
        return super().step(closure)


def hvd_run(sparse_as_dense: bool, micro: int, predivide: float = 1.0,
            mode: str = "hvd") -> tuple:
    """(weights after every step, weights before every step, gradients handed). ``mode``:
    'hvd' (the optimizer under test), 'local' (bare SparseAdam: no exchange), 'adam'
    (DistributedOptimizer over Adam on a dense embedding: the gradient densified)."""
    model = make_model(sparse=mode != "adam")
    if mode == "adam":
        opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=LR),
                                       named_parameters=model.named_parameters(),
                                       backward_passes_per_step=micro)
    else:
        opt = Recording(list(model.parameters()), lr=LR)
        if mode == "hvd":
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           backward_passes_per_step=micro,
                                           sparse_as_dense=sparse_as_dense,
                                           gradient_predivide_factor=predivide)
    after, before = [], []
    for s in range(STEPS):
        before.append(model.weight.detach().clone())
        opt.zero_grad()
        for k in range(micro):
            loss_of(model, *batch(hvd.rank(), s, k)).backward()
        opt.step()
        after.append(model.weight.detach().clone())
    return after, before, getattr(opt, "handed", [])


def reference(micro: int) -> list:
    """SparseAdam in this process over every rank's batch: the mean of the ranks' losses."""
    model = make_model()
    opt = torch.optim.SparseAdam(list(model.parameters()), lr=LR)
    n = hvd.size()
    history = []
    for s in range(STEPS):
        opt.zero_grad()
        for k in range(micro):
            (sum(loss_of(model, *batch(r, s, k)) for r in range(n)) / n).backward()
        opt.step()
        history.append(model.weight.detach().clone())
    return history


def local_grads(weight: torch.Tensor, step: int, micro: int) -> list:
    """Every rank's accumulated sparse gradient at ``step``, recomputed here from
    ``weight`` (the replicas' common weights before the step)."""
    grads = []
    for r in range(hvd.size()):
        model = make_model()
        with torch.no_grad():
            model.weight.copy_(weight)
        for k in range(micro):
            loss_of(model, *batch(r, step, k)).backward()
        grads.append(model.weight.grad)
    return grads


def horovod_grad(grads: list, sparse_as_dense: bool, coalesce_first: bool = False):
    """What Horovod 0.28.1's DistributedOptimizer (op=Average) hands the optimizer."""
    n = len(grads)
    if n == 1:   # size 1: no hooks registered, synchronize() leaves .grad alone
        return grads[0]
    if sparse_as_dense:
        dense = sum(g.to_dense() for g in grads) / n
        return grads[0].clone().zero_().add_(dense.to_sparse())
    if coalesce_first:
        grads = [g.coalesce() for g in grads]
    gathered = grads[0].new(torch.cat([g._indices() for g in grads], 1),
                            torch.cat([g._values() for g in grads]) / n, grads[0].size())
    return grads[0].clone().zero_().add_(gathered)


def grad_differs(got: torch.Tensor, want: torch.Tensor, exact: bool) -> str:
    """'' when ``got`` has ``want``'s layout, sparse dims, coalesced flag and indices and
    its values (bit for bit when ``exact``, else 1e-12), otherwise what differs."""
    if not got.is_sparse:
        return f"a {got.layout} gradient, not sparse"
    for what in ("sparse_dim", "dense_dim", "is_coalesced", "_nnz"):
        a, b = getattr(got, what)(), getattr(want, what)()
        if a != b:
            return f"{what} {a} != {b}"
    if not torch.equal(got._indices(), want._indices()):
        return "indices differ"
    a, b = got._values(), want._values()
    if not (torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-12, atol=1e-14)):
        return f"values differ by {float((a - b).abs().max()):.3e}"
    return ""


def weights_differ(ours: list, ref: list) -> str:
    for s, (a, b) in enumerate(zip(ours, ref)):
        if not torch.allclose(a, b, rtol=1e-10, atol=1e-12):
            return f"step {s}: max |diff| {float((a - b).abs().max()):.3e}"
    return ""


CASES = [(False, 1, 1.0), (True, 1, 1.0), (False, 2, 1.0), (True, 2, 1.0), (False, 1, 3.0)]


def test_sparse_adam_gets_horovods_sparse_gradient():
    """Every case's weights after every step match the one-process reference, and every
    step's handed gradient is Horovod's (module docstring); the controls are rejected."""
    me, n = hvd.rank(), hvd.size()
    refs = {micro: reference(micro) for micro in (1, 2)}
    failures = []
    for sparse_as_dense, micro, predivide in CASES:
        case = f"sparse_as_dense={sparse_as_dense} micro={micro} predivide={predivide}"
        after, before, handed = hvd_run(sparse_as_dense, micro, predivide)
        why = weights_differ(after, refs[micro])
        if why:
            failures.append(f"{case}: weights {why}")
        assert len(handed) == STEPS, case
        for s in range(STEPS):
            grads = local_grads(before[s], s, micro)
            want = horovod_grad(grads, sparse_as_dense)
            # bit for bit but for the dense sum (MPI's order at 3+ ranks, * 1/n)
            why = grad_differs(handed[s], want, exact=not sparse_as_dense or n == 1)
            if why:
                failures.append(f"{case}: step {s} gradient: {why}")
            if s == 0:   # the checker tells the formats apart
                other = horovod_grad(grads, not sparse_as_dense)
                assert n == 1 or grad_differs(other, want, exact=False), \
                    f"rank {me}: the gradient check did not reject the other mode's format"
                if not sparse_as_dense and n > 1:
                    bad = horovod_grad(grads, False, coalesce_first=True)
                    assert grad_differs(bad, want, exact=True), \
                        f"rank {me}: the gradient check did not reject coalesced gathers"
    assert not failures, f"rank {me} of {n}: " + "; ".join(failures)
    # negative controls, on every rank
    assert weights_differ(hvd_run(False, 1, mode="adam")[0], refs[1]), \
        f"rank {me}: the comparison did not reject a densified gradient (Adam)"
    if n > 1:
        local_after, _, _ = hvd_run(False, 1, mode="local")
        assert weights_differ(local_after, refs[1]), \
            f"rank {me}: the comparison did not reject an optimizer that skips the exchange"


def test_sparse_allreduce_async_gathers_uncoalesced_entries():
    """Each rank's entries as given (duplicates kept, nothing coalesced), in rank order,
    values / size for Average, as they are for Sum; a dense tensor is a TypeError naming
    the argument and the rank."""
    me, n = hvd.rank(), hvd.size()

    def entries(r: int) -> tuple:   # rank r holds r + 2 entries, row r % 5 twice
        rows = [r % 5, r % 5] + [(r + 3) % 5] * r
        return (torch.tensor([rows]),
                torch.arange(len(rows) * 2, dtype=torch.float64).reshape(-1, 2) + 10 * r)

    mine = torch.sparse_coo_tensor(*entries(me), (5, 2), check_invariants=False)
    assert not mine.is_coalesced()
    for op, div in ((hvd.Average, n), (hvd.Sum, 1)):
        got = hvd.sparse_allreduce_async(mine, name=f"sparse.layout.{op}", op=op)()
        want_i = torch.cat([entries(r)[0] for r in range(n)], 1)
        want_v = torch.cat([entries(r)[1] for r in range(n)]) / div
        assert got.is_sparse and not got.is_coalesced() and got.size() == (5, 2), (me, op)
        assert torch.equal(got._indices(), want_i), (me, op, got._indices())
        assert torch.equal(got._values(), want_v), (me, op)
        assert torch.equal(mine._indices(), entries(me)[0]), "the input was modified"
    with pytest.raises(TypeError, match=rf"rank {me}\).*'tensor'"):
        hvd.sparse_allreduce_async(torch.ones(3), name="sparse.dense", op=hvd.Sum)


def test_cached_collectives_with_rank_dependent_shapes():
    """A named alltoall and allgather whose splits / first dimension differ between ranks,
    repeated: from the second call on every rank announces the same response-cache id (the
    common round). Each result equals its closed form every time (the alltoall's received
    rows came from the cache entry's splits of every rank: this rank's own splits taken
    for every rank's gave garbage and MPI errors at 2 ranks), and every rank's response
    cache holds the same entries (this rank's shapes taken for everyone's gave the ranks
    different caches, then a KeyError at 3 ranks in the sparse exchange above)."""
    from commlib.horovod import state
    me, n = hvd.rank(), hvd.size()

    def received(r: int, it: int) -> torch.Tensor:   # what rank r gets from the alltoall
        return torch.cat([torch.full((s + 1 + r + it % 2,), 100.0 * s + r + it)
                          for s in range(n)]).double()

    if n > 1:   # the comparison tells the ranks' results apart
        assert not torch.equal(received(me, 0), received((me + 1) % n, 0))
    for it in range(5):
        splits = [me + 1 + d + it % 2 for d in range(n)]
        t = torch.cat([torch.full((k,), 100.0 * me + d + it)
                       for d, k in enumerate(splits)]).double()
        out, recv = hvd.alltoall(t, splits=torch.tensor(splits, dtype=torch.int32),
                                 name="cached.alltoall")
        assert torch.equal(out, received(me, it)), (me, it, out.tolist(), recv.tolist())
        rows = (me + it // 2) % 3 + 1   # the ranks' shapes change between calls
        got = hvd.allgather(torch.full((rows, 2), float(me + it)).double(),
                            name="cached.allgather")
        want = torch.cat([torch.full(((r + it // 2) % 3 + 1, 2), float(r + it))
                          for r in range(n)]).double()
        assert torch.equal(got, want), (me, it)
    ctrl = state.require("test").controllers[hvd.global_process_set.process_set_id]
    mine = repr(sorted(ctrl.cache.items()))
    caches = hvd.allgather_object(mine, name="cached.caches")
    assert all(c == mine for c in caches), \
        f"rank {me}: the ranks' response caches differ: " \
        f"{[r for r, c in enumerate(caches) if c != mine]}"
