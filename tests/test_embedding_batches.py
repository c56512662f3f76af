"""What a batch of a sharded table is (issue 19): everything between two optimizer steps.

Gradient accumulation over micro-batches (also under DDP's ``no_sync``), several lookups of
one table per batch and evaluation forwards between steps give torch's results; lookups
outside a ``LookaheadLoader``/``PrefetchLoader`` (evaluation, after leaving the loop
early) read the updated rows and do not disturb the loader; leaving the loop releases
what it prepared; ``padding_idx``/``max_norm``/``mode="max"`` follow torch.
"""
import copy

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import commlib  # noqa: E402
from commlib.embedding import LookaheadLoader, PrefetchLoader  # noqa: E402

F64 = torch.float64
N, D = 19, 3


def world():
    return commlib.get_rank(), commlib.get_world_size()


def w0(seed=0):
    return torch.randn(N, D, dtype=F64, generator=torch.Generator().manual_seed(seed))


def global_ids(seed, n, per_rank=3, bag=4):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(n * per_rank, bag, generator=gen) ** 2 * N).long()


def mine(t, per_rank=3):
    rank = commlib.get_rank()
    return t[rank * per_rank:(rank + 1) * per_rank]


def ref_step(opt, emb):
    emb.weight.grad = emb.weight.grad.coalesce()
    opt.step()
    emb.weight.grad = None


# -- item 9: gradient accumulation --------------------------------------------------------
class Net(nn.Module):
    def __init__(self, emb, head):
        super().__init__()
        self.emb, self.head = emb, head

    def forward(self, ids):
        return self.head(self.emb(ids))


@pytest.mark.mpi
@pytest.mark.parametrize("no_sync", [False, True])
def test_accumulation_is_one_update_per_optimizer_step(no_sync, one_thread_per_rank):
    """Two forward/backward passes then one step: one Adagrad update of the summed
    gradient, as ``nn.EmbeddingBag(sparse=True)`` (also inside DDP's ``no_sync``)."""
    rank, n = world()
    emb = commlib.ShardedEmbeddingBag(N, D, mode="sum", optimizer="adagrad", lr=0.3,
                                      dtype=F64, _weight=w0())
    ddp = commlib.DistributedDataParallel(Net(emb, nn.Linear(D, 1, dtype=F64)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    ref = Net(nn.EmbeddingBag(N, D, mode="sum", sparse=True, _weight=w0(), dtype=F64),
              copy.deepcopy(ddp.module.head))
    ropt = torch.optim.Adagrad(ref.emb.parameters(), lr=0.3)
    try:
        for step in range(3):
            opt.zero_grad()
            for m in range(2):
                ids = global_ids(10 * step + m, n)
                if no_sync and m == 0:
                    with ddp.no_sync():
                        (ddp(mine(ids)).pow(2).mean() / 2).backward()
                else:
                    (ddp(mine(ids)).pow(2).mean() / 2).backward()
                (ref(ids).pow(2).mean() / 2).backward()
            opt.step()  # closes the embedding batch: one update
            ref_step(ropt, ref.emb)
            err = (emb.state_dict()["weight"] - ref.emb.weight).abs().max().item()
            assert err < 1e-12, f"rank {rank} step {step}: table differs by {err}"
        assert emb.optimizer_state_dict()["step"] == 3
    finally:
        emb.close()
        del ddp


# -- item 13: several lookups per batch, eval forward without backward ----------------------
@pytest.mark.mpi
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_lookups_of_one_table_and_an_eval_forward(optimizer, one_thread_per_rank):
    """User and item ids share one table; an eval forward with autograd on and no backward
    runs between steps: no error, and torch's results (Adam counts one step per batch)."""
    rank, n = world()
    emb = commlib.ShardedEmbedding(N, D, optimizer=optimizer, lr=0.1, dtype=F64,
                                   _weight=w0(1))
    ref = nn.Embedding(N, D, sparse=True, _weight=w0(1), dtype=F64)
    ropt = {"sgd": torch.optim.SGD, "adam": torch.optim.SparseAdam}[optimizer](
        ref.parameters(), lr=0.1)
    try:
        for step in range(4):
            users, items = global_ids(step, n), global_ids(100 + step, n)
            for module, u, i in ((emb, mine(users), mine(items)), (ref, users, items)):
                score = (module(u) * module(i)).sum(-1)
                (score.tanh() - 0.5).pow(2).mean().backward()
            emb.step()
            ref_step(ropt, ref)
            probe = global_ids(200 + step, n)
            emb.eval()
            ref.eval()
            out, want = emb(mine(probe)), ref(probe)  # autograd on, never backward
            emb.train()
            ref.train()
            assert (out - mine(want)).abs().max().item() < 1e-12, f"rank {rank} step {step}"
            err = (emb.state_dict()["weight"] - ref.weight).abs().max().item()
            assert err < 1e-12, f"rank {rank} step {step}: table differs by {err}"
        assert emb.optimizer_state_dict()["step"] == 4
    finally:
        emb.close()


# -- item 5: LookaheadLoader --------------------------------------------------------------
def _lookahead_run(n, how, control=False):
    """Train through a LookaheadLoader with an evaluation lookup after every step; leave
    the loop after 3 of 6 batches (``how``), train on without it. Returns the largest
    difference from synchronous training (torch on the global batch)."""
    emb = commlib.ShardedEmbeddingBag(N, D, mode="mean", optimizer="adagrad", lr=0.5,
                                      dtype=F64, _weight=w0(2))
    ref = nn.EmbeddingBag(N, D, mode="mean", sparse=True, _weight=w0(2), dtype=F64)
    ropt = torch.optim.Adagrad(ref.parameters(), lr=0.5)
    batches = [global_ids(300 + s, n, bag=2) for s in range(6)]
    worst = 0.0

    def train(s):
        nonlocal worst
        emb(mine(batches[s])).pow(2).sum().backward()
        ref(batches[s]).pow(2).sum().div(n).backward()
        emb.step()
        ref_step(ropt, ref)
        probe = torch.arange(N).reshape(N, 1)  # every row (on every rank)
        with torch.no_grad():
            worst = max(worst, (emb(probe) - ref(probe)).abs().max().item())

    loader = LookaheadLoader(range(6), [emb], lambda s: [mine(batches[s])], lookahead=1)
    it = iter(loader)
    try:
        for s in it:
            train(s)
            if s == 2:
                break
        if how == "close":
            loader.close()
        if how != "keep":
            del it
        handed_back = emb.table.policy is emb.table
        for s in range(3, 6):
            train(s)
        worst = max(worst, (emb.state_dict()["weight"] - ref.weight).abs().max().item())
        if control:
            return worst
        assert worst < 1e-12, f"rank {commlib.get_rank()}: lookups outside the schedule " \
                              f"differ by {worst}"
        assert handed_back == (how != "keep"), "the schedule did not hand the table back"
        with pytest.warns(RuntimeWarning, match="used 0 of the 1 lookups"):
            again = [x for x in loader]  # a second pass (a fresh schedule), no training
        assert len(again) == 6
    finally:
        emb.close()
    return worst


@pytest.mark.mpi
@pytest.mark.parametrize("how", ["break", "close", "keep"])
def test_lookahead_outside_lookups_read_updated_rows(how, one_thread_per_rank):
    _lookahead_run(world()[1], how)


@pytest.mark.mpi
def test_lookahead_stale_outside_reads_are_caught(one_thread_per_rank, monkeypatch):
    """Negative control: outside lookups that do not apply the background part."""
    from commlib.embedding import lookahead as la
    monkeypatch.setattr(la._Schedule, "before_read", lambda self, ids, grad: None)
    _, n = world()
    assert _lookahead_run(n, "keep", control=True) > 1e-6


@pytest.mark.mpi
def test_lookahead_load_state_dict_mid_pass(one_thread_per_rank):
    """Loading a table in the middle of a pass: rows held for later batches are fetched
    again (they predate the load)."""
    rank, n = world()
    emb = commlib.ShardedEmbeddingBag(N, D, mode="sum", optimizer="sgd", lr=0.3,
                                      dtype=F64, _weight=w0(5))
    ref = nn.EmbeddingBag(N, D, mode="sum", sparse=True, _weight=w0(5), dtype=F64)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.3)
    batches = [global_ids(900 + s, n, bag=2) for s in range(5)]
    try:
        for s in LookaheadLoader(range(5), [emb], lambda s: [mine(batches[s])],
                                 lookahead=3):
            emb(mine(batches[s])).pow(2).sum().backward()
            ref(batches[s]).pow(2).sum().div(n).backward()
            emb.step()
            ref_step(ropt, ref)
            if s == 1:
                emb.load_state_dict({"weight": w0(6)})
                with torch.no_grad():
                    ref.weight.copy_(w0(6))
        err = (emb.state_dict()["weight"] - ref.weight).abs().max().item()
        assert err < 1e-12, f"rank {rank}: table differs by {err} after a load mid-pass"
    finally:
        emb.close()


# -- item 14: PrefetchLoader --------------------------------------------------------------
@pytest.mark.mpi
def test_prefetch_serves_only_training_lookups_and_releases_leftovers(one_thread_per_rank):
    """Evaluation lookups between steps neither consume nor disturb the prefetched
    queue (training equals a run without them); leaving the loop, ``close()`` and
    ``flush()`` release the prepared lookups, and training goes on after."""
    rank, n = world()

    def run(evaluate, end):
        emb = commlib.ShardedEmbeddingBag(N, D, mode="sum", optimizer="sgd", lr=0.1,
                                          staleness=2, dtype=F64, _weight=w0(3))
        batches = [mine(global_ids(500 + s, n)) for s in range(6)]
        loader = PrefetchLoader(range(6), [emb], lambda s: [batches[s]])
        tables = []
        try:
            it = iter(loader)
            for s in it:
                emb(batches[s]).pow(2).sum().backward()
                emb.step()
                if evaluate:
                    probe = mine(global_ids(600 + s, n))
                    with torch.no_grad():
                        out = emb(probe)
                    emb.eval()
                    out2 = emb(probe)  # autograd on, eval mode: not a training lookup
                    emb.train()
                    table = emb.table.full()  # what the lookups read: the table as it is
                    want = F.embedding_bag(probe, table, mode="sum")
                    assert (out - want).abs().max() < 1e-12 and torch.equal(out, out2)
                tables.append(emb.table.full())
                if s == 2:
                    break
            assert len(emb._outstanding) == 2  # batches 3 and 4 were prefetched
            if end == "break":
                del it  # the loop's iterator dropped: the pass ends
            elif end == "close":
                loader.close()
            else:
                emb.flush()
            assert emb._outstanding == [], f"rank {rank}: {end} left prepared lookups"
            it = None
            for s in range(3, 5):  # on without the loader, on other ids than it prepared
                emb(mine(global_ids(800 + s, n))).pow(2).sum().backward()
                emb.step()
                tables.append(emb.table.full())
        finally:
            emb.close()
        return tables

    runs = {end: run(True, end) for end in ("break", "close", "flush")}
    plain = run(False, "break")
    for end, got in runs.items():
        for s, (a, b) in enumerate(zip(got, plain)):
            if end == "flush" and s >= 3:
                break  # a flush applies the queue early: a different (valid) schedule
            assert torch.equal(a, b), f"rank {rank} {end}: step {s} differs"


# -- item 20: padding_idx, max_norm, norm_type, mode="max" --------------------------------
@pytest.mark.parametrize("kind", ["sum", "mean", "max", "embedding"])
def test_padding_and_max_norm_match_torch_on_one_rank(kind):
    group = commlib.new_subgroup([commlib.get_rank()])
    kw = dict(padding_idx=-3, max_norm=1.1, norm_type=1.5)
    weight = w0(4) * 2
    if kind == "embedding":
        ref = nn.Embedding(N, D, sparse=True, _weight=weight.clone(), dtype=F64, **kw)
        emb = commlib.ShardedEmbedding(N, D, group=group, optimizer="adagrad", lr=0.2,
                                       dtype=F64, _weight=weight, **kw)
    else:
        ref = nn.EmbeddingBag(N, D, mode=kind, sparse=kind != "max", _weight=weight.clone(),
                              dtype=F64, **kw)
        emb = commlib.ShardedEmbeddingBag(N, D, mode=kind, group=group, optimizer="adagrad",
                                          lr=0.2, dtype=F64, _weight=weight, **kw)
    assert emb.padding_idx == ref.padding_idx == N - 3
    ropt = torch.optim.Adagrad(ref.parameters(), lr=0.2)
    try:
        for step in range(4):
            ids = global_ids(700 + step, 1, per_rank=5)
            ids[:, ::2] = N - 3  # padding entries, and a bag of padding only
            ids[0] = N - 3
            outs = [m(ids) for m in (emb, ref)]
            assert (outs[0] - outs[1]).abs().max().item() < 1e-12, f"{kind} step {step}"
            for o in outs:
                o.tanh().sum().backward()
            g = ref.weight.grad
            if not g.is_sparse:  # mode="max": the looked-up rows' gradient
                rows = torch.unique(ids)
                rows = rows[rows != N - 3]
                ref.weight.grad = torch.sparse_coo_tensor(rows[None], g[rows], g.shape)
            ref_step(ropt, ref)
            emb.step()
            err = (emb.state_dict()["weight"] - ref.weight).abs().max().item()
            assert err < 1e-12, f"{kind} step {step}: table differs by {err}"
        with torch.no_grad():  # evaluation renormalises too (torch's forward does)
            ids = torch.arange(N).reshape(1, N)
            assert (emb(ids) - ref(ids)).abs().max().item() < 1e-12
        assert (emb.state_dict()["weight"] - ref.weight).abs().max().item() < 1e-12
    finally:
        emb.close()
        group.free()


@pytest.mark.mpi
def test_padding_row_starts_at_zero_and_bad_arguments_raise_on_every_rank():
    emb = commlib.ShardedEmbeddingBag(N, D, padding_idx=5, dtype=F64)
    try:
        full = emb.state_dict()["weight"]
        assert torch.equal(full[5], torch.zeros(D, dtype=F64))
        assert bool((full.abs().sum(1) > 0).sum() == N - 1)
        mean = commlib.ShardedEmbeddingBag(N, D, mode="mean", dtype=F64)
        with pytest.raises(NotImplementedError, match="per_sample_weights"):
            mean(torch.zeros(1, 2, dtype=torch.long),
                 per_sample_weights=torch.ones(1, 2, dtype=F64))
        mean.close()
    finally:
        emb.close()
    for cls in (commlib.ShardedEmbeddingBag, commlib.ShardedEmbedding):
        with pytest.raises(ValueError, match=r"rank \d+.*'padding_idx'=19 must be within"):
            cls(N, D, padding_idx=N)
        with pytest.raises(ValueError, match="'padding_idx'=-20"):
            cls(N, D, padding_idx=-N - 1)
        with pytest.raises(ValueError, match="'max_norm'.*'cache'"):
            cls(N, D, max_norm=1.0, cache=commlib.EmbeddingCache(4))
        with pytest.raises(ValueError, match="'max_norm'"):
            cls(N, D, max_norm=-1.0)
