"""Differential suite: commlib's sharded embeddings against ``nn.EmbeddingBag`` /
``nn.Embedding`` trained with torch's optimizers, in the same mpiexec job, float64.

Every rank builds the same generated cases from the seed and trains the torch module on
the *global* batch (all ranks' samples; the mean loss over them equals the mean over ranks
of each rank's mean loss, as the table averages row gradients over the group) while the
sharded module trains on its own slice. Compared on every rank, after every step: the
output of every lookup (training and evaluation) against the reference's rows for this
rank's samples, and the whole table (gathered). A case draws: ``ShardedEmbeddingBag``
(``sum``/``mean``/``max``; 2-D bags or 1-D ids with ``offsets``, empty bags,
``include_last_offset``, ``per_sample_weights``) or ``ShardedEmbedding``; SGD, Adagrad or
Adam (torch: ``SGD``/``Adagrad``/``SparseAdam`` on the coalesced sparse gradient; for
``max``, whose torch module is dense, on the gradient of the looked-up rows);
``padding_idx`` (a zero or a non-zero padding row); ``max_norm`` with ``norm_type``;
several lookups of the table per batch; gradient accumulation over micro-batches;
evaluation forwards between steps (``no_grad``, eval mode with autograd on and no
backward, training mode with no backward); the step from a torch optimizer, from
``emb.step()``, or both; no loader, a ``PrefetchLoader``, a ``LookaheadLoader`` (listing
some or all lookups of a batch; leaving the loop early by ``break``, ``close()`` or
keeping the iterator, then training on without it) or an ``EmbeddingCache`` with bounds
0 (which claims the synchronous result).

Negative controls the same checker must reject: owners that drop the gradients other
ranks send (a table that never exchanges gradients), one update per micro-batch, a
lookahead schedule whose outside lookups read the rows before the background part of the
last update, and a bag that does not leave the padding entries out.
"""
import random
import types

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import commlib  # noqa: E402
from commlib.embedding import EmbeddingCache, LookaheadLoader, PrefetchLoader  # noqa: E402
from commlib.embedding import lookahead as la  # noqa: E402
from commlib.embedding import module as emb_module  # noqa: E402

F64 = torch.float64
TOL = 1e-10
CASES = 64  # per world size (1-4 ranks: 256 distinct cases)
TORCH_OPT = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad,
             "adam": torch.optim.SparseAdam}


class Case:
    """One generated case (the same on every rank: drawn from ``seed`` alone)."""

    def __init__(self, seed, **force):
        r = random.Random(seed)
        self.seed = seed
        self.kind = r.choice(["bag", "bag", "embedding"])
        self.mode = r.choice(["sum", "mean", "max"]) if self.kind == "bag" else None
        self.optimizer = r.choice(["sgd", "adagrad", "adam"])
        self.lr = r.choice([0.05, 0.2, 0.5])
        self.N, self.D = r.randint(4, 20), r.randint(1, 4)
        self.padding_idx = r.choice([None, r.randint(-self.N, self.N - 1)])
        self.zero_padding_row = r.random() < 0.5
        self.max_norm = r.choice([None, None, r.choice([0.6, 1.0, 1.7])])
        self.norm_type = r.choice([1.0, 2.0, 3.0])
        self.lookups = r.choice([1, 1, 2, 3])
        self.micro = r.choice([1, 1, 2, 3])
        self.steps = r.randint(2, 4)
        self.B, self.L = r.randint(1, 3), r.randint(1, 4)
        self.offsets = self.kind == "bag" and r.random() < 0.4
        self.include_last = self.offsets and r.random() < 0.5
        self.psw = self.mode == "sum" and r.random() < 0.5
        self.loader = r.choice(["plain", "plain", "prefetch", "lookahead", "lookahead",
                                "cache"])
        self.listed = r.randint(1, self.lookups * self.micro)
        self.lookahead = r.randint(0, 3)
        self.brk = r.choice([None, r.randint(1, self.steps)])
        self.end = r.choice(["break", "close", "keep"])
        self.evals = [r.choice([None, "no_grad", "eval_grad", "train_grad"])
                      for _ in range(self.steps)]
        self.stepper = r.choice(["optimizer", "module", "both"])
        self.checkpoint = [r.random() < 0.5 for _ in range(self.steps)]
        self.capacity = r.randint(2, 8)
        self.policy = r.choice(["lru", "lfu"])
        self.__dict__.update(force)
        self.listed = min(self.listed, self.lookups * self.micro)
        self.evals = (self.evals * self.steps)[:self.steps]
        self.checkpoint = (self.checkpoint * self.steps)[:self.steps]
        if self.brk is not None:
            self.brk = min(self.brk, self.steps)
        if self.loader == "cache":
            self.max_norm = None  # refused with a cache (the owners renormalise)

    def __repr__(self):
        keys = ("kind", "mode", "optimizer", "padding_idx", "max_norm", "lookups", "micro",
                "offsets", "psw", "loader", "listed", "lookahead", "brk", "end", "evals",
                "stepper")
        return f"case {self.seed}(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in keys) + ")"


class Data:
    """The global batches of a case (every rank alike) and this rank's slices."""

    def __init__(self, case, n, rank):
        self.case, self.n, self.rank = case, n, rank
        self.gen = torch.Generator().manual_seed(10_000 + case.seed)

    def ids(self, shape):
        c = self.case
        # skewed (rows shared by ranks and lookups), with padding entries
        ids = (torch.rand(shape, generator=self.gen) ** 2 * c.N).long().clamp_(max=c.N - 1)
        if c.padding_idx is not None:
            pad = c.padding_idx % c.N
            ids[torch.rand(shape, generator=self.gen) < 0.25] = pad
        return ids

    def lookup(self):
        """(global args, local args) of one lookup of n * B samples."""
        c, n, B = self.case, self.n, self.case.B
        mine = slice(self.rank * B, (self.rank + 1) * B)
        if not c.offsets:
            ids = self.ids((n * B, c.L))
            psw = torch.rand(ids.shape, dtype=F64, generator=self.gen) if c.psw else None
            glob = (ids,) if psw is None else (ids, None, psw)
            loc = (ids[mine],) if psw is None else (ids[mine], None, psw[mine])
            return glob, loc
        lengths = torch.randint(0, c.L + 1, (n * B,), generator=self.gen)
        ids = self.ids((int(lengths.sum()),))
        psw = torch.rand(ids.shape, dtype=F64, generator=self.gen) if c.psw else None
        starts = torch.cumsum(lengths, 0) - lengths
        lo, hi = int(starts[mine.start]), int(starts[mine.stop - 1] + lengths[mine.stop - 1])

        def offsets(lens):
            off = torch.cumsum(lens, 0) - lens
            return torch.cat([off, off[-1:] + lens[-1:]]) if c.include_last else off
        glob = (ids, offsets(lengths), psw)
        loc = (ids[lo:hi], offsets(lengths[mine]), None if psw is None else psw[lo:hi])
        return glob, loc

    def target(self):
        y = torch.randn(self.n * self.case.B, self.case.D, dtype=F64, generator=self.gen)
        return y, y[self.rank * self.case.B:(self.rank + 1) * self.case.B]


def loss_of(outs, y, coef):
    """Mean per-sample loss of a batch's lookups (embedding outputs averaged over L)."""
    outs = [o.mean(1) if o.dim() == 3 else o for o in outs]
    z = sum(c * o for c, o in zip(coef, outs))
    if len(outs) > 1:
        z = z + outs[0] * outs[1]
    return (torch.tanh(z) - y).pow(2).sum(-1).mean()


def build(case, w0, group=None):
    kw = dict(padding_idx=case.padding_idx, max_norm=case.max_norm,
              norm_type=case.norm_type)
    cache = None
    if case.loader == "cache":
        cache = EmbeddingCache(case.capacity, policy=case.policy)
    if case.kind == "bag":
        ref = nn.EmbeddingBag(case.N, case.D, mode=case.mode, sparse=case.mode != "max",
                              _weight=w0.clone(), include_last_offset=case.include_last,
                              dtype=F64, **kw)
        emb = commlib.ShardedEmbeddingBag(case.N, case.D, mode=case.mode,
                                          optimizer=case.optimizer, lr=case.lr, dtype=F64,
                                          include_last_offset=case.include_last,
                                          _weight=w0, cache=cache, group=group, **kw)
    else:
        ref = nn.Embedding(case.N, case.D, sparse=True, _weight=w0.clone(), dtype=F64, **kw)
        emb = commlib.ShardedEmbedding(case.N, case.D, optimizer=case.optimizer, lr=case.lr,
                                       dtype=F64, _weight=w0, cache=cache, group=group, **kw)
    return ref, emb


def ref_step(case, ref, opt, used):
    """torch's optimizer on the coalesced sparse gradient (for ``max``: the dense
    gradient's rows that were looked up, padding excluded)."""
    g = ref.weight.grad
    if g.is_sparse:
        g = g.coalesce()
    else:
        rows = torch.unique(torch.cat(used)) if used else torch.zeros(0, dtype=torch.long)
        if case.padding_idx is not None:
            rows = rows[rows != case.padding_idx % case.N]
        g = torch.sparse_coo_tensor(rows[None], g[rows], g.shape).coalesce()
    ref.weight.grad = g
    opt.step()
    ref.weight.grad = None


def run_case(case, control=None):
    """Train the case; the largest difference from torch seen on this rank (inf and the
    message when the sharded module raised)."""
    rank, n = commlib.get_rank(), commlib.get_world_size()
    data = Data(case, n, rank)
    w0 = torch.randn(case.N, case.D, dtype=F64, generator=data.gen)
    if case.padding_idx is not None and case.zero_padding_row:
        w0[case.padding_idx] = 0
    ref, emb = build(case, w0)
    if control == "drop_remote":
        emb.table.apply_filter = drop_remote
    ropt = TORCH_OPT[case.optimizer]([ref.weight], lr=case.lr)
    dense = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)  # the user's
    coef = torch.randn(case.lookups, dtype=F64, generator=data.gen)
    # every batch's lookups drawn up front (a loader's inputs must know them)
    batches = [[[data.lookup() for _ in range(case.lookups)] for _ in range(case.micro)]
               for _ in range(case.steps)]
    targets = [[data.target() for _ in range(case.micro)] for _ in range(case.steps)]
    evals = [data.lookup() for _ in range(case.steps)]
    worst = [0.0]

    def close(a, b):
        worst[0] = max(worst[0], (a.detach() - b.detach()).abs().max().item()
                       if a.numel() else 0.0)
        if a.shape != b.shape:
            worst[0] = float("inf")

    def mine(out):
        return out[rank * case.B:(rank + 1) * case.B]

    def train(s):
        used = []
        for m in range(case.micro):
            outs, routs = [], []
            for glob, loc in batches[s][m]:
                outs.append(emb(*loc))
                routs.append(ref(*glob))
                close(outs[-1], mine(routs[-1]))
                used.append(glob[0].reshape(-1))
            y, y_mine = targets[s][m]
            loss_of(outs, y_mine, coef).backward()
            loss_of(routs, y, coef).backward()
            if control == "micro_step":
                emb.step()  # broken: one update per micro-batch
        if case.stepper in ("optimizer", "both"):
            dense.step()  # the global post hook closes the batch
        if case.stepper in ("module", "both"):
            emb.step()
        ref_step(case, ref, ropt, used)

    def evaluate(s):
        how = case.evals[s]
        if how is None:
            return
        glob, loc = evals[s]
        if how == "no_grad":
            with torch.no_grad():
                close(emb(*loc), mine(ref(*glob)))
        else:  # autograd on, no backward (eval mode or not)
            train_mode = how == "train_grad"
            emb.train(train_mode)
            ref.train(train_mode)
            close(emb(*loc), mine(ref(*glob)))
            emb.train()
            ref.train()

    def check_table(s, flush):
        full = emb.state_dict()["weight"] if flush else emb.table.full()
        close(full, ref.weight)

    def inputs(s):
        return [loc[0] for m in batches[s] for _, loc in m][:case.listed]

    try:
        loaders = {"prefetch": lambda: PrefetchLoader(range(case.steps), [emb] * case.listed,
                                                      inputs),
                   "lookahead": lambda: LookaheadLoader(range(case.steps),
                                                        [emb] * case.listed, inputs,
                                                        lookahead=case.lookahead)}
        s, lagging = 0, False
        if case.loader in loaders:
            loader = loaders[case.loader]()
            it = iter(loader)
            for s in it:
                train(s)
                evaluate(s)
                lagging = case.loader == "lookahead"  # owners may lag (background part)
                if not lagging or case.checkpoint[s]:
                    check_table(s, flush=lagging)
                if case.brk is not None and s + 1 == case.brk:
                    break
            s += 1
            if case.end == "close":
                loader.close()
            if case.end != "keep":
                del it
            lagging = lagging and case.end == "keep"  # the schedule still runs
        for s in range(s, case.steps):  # no loader (or on without it after leaving early)
            train(s)
            evaluate(s)
            if not lagging or case.checkpoint[s]:
                check_table(s, flush=lagging)
        check_table(case.steps, flush=True)
    except Exception as exc:  # every rank raises alike: record, stay in step
        return float("inf"), f"{type(exc).__name__}: {exc}"
    finally:
        emb.close()
    return worst[0], ""


def drop_remote(table, ids, grads, recv_splits):
    """Negative control: an owner applies only its own rows' gradients."""
    start = sum(recv_splits[:table.rank])
    keep = slice(start, start + recv_splits[table.rank])
    return ids[keep], grads[keep]


def run_cases(cases, control=None):
    """Each case's largest difference over all ranks (the same list on every rank) and
    the messages of cases that raised anywhere."""
    errs, notes = [], {}
    for case in cases:
        err, note = run_case(case, control)
        errs.append(err)
        if note:
            notes[case.seed] = note
    worst = commlib.allreduce(torch.tensor(errs, dtype=F64), op=commlib.ReduceOp.MAX)
    return worst.tolist(), notes


@pytest.mark.mpi
def test_sharded_embeddings_equal_torch(one_thread_per_rank):
    n = commlib.get_world_size()  # other cases at each world size
    cases = [Case(seed) for seed in range(CASES * (n - 1), CASES * n)]
    worst, notes = run_cases(cases)
    bad = [f"{case}: {err:.3g} {notes.get(case.seed, '')}"
           for case, err in zip(cases, worst) if not err < TOL]
    assert not bad, f"rank {commlib.get_rank()}: {len(bad)} of {len(cases)} cases " \
                    f"differ from torch:\n" + "\n".join(bad)


def controls():
    """(name, cases that exercise it, how to break the library) per negative control."""
    n = commlib.get_world_size()
    out = [("micro_step", [Case(1000 + i, micro=2 + i % 2, loader=["plain", "prefetch",
                                                                   "lookahead", "cache"][i % 4],
                                brk=None) for i in range(4)], None)]
    if n > 1:
        out.append(("drop_remote", [Case(1100 + i, brk=None) for i in range(4)], None))
    out.append(("stale_lookahead", [Case(1200 + i, loader="lookahead", evals=["no_grad"] * 4,
                                         steps=4, B=3, L=4, brk=None, micro=1)
                                    for i in range(4)], "stale"))
    out.append(("padding_in_bag", [Case(1300 + i, kind="bag", mode=["sum", "mean", "max",
                                                                     "mean"][i],
                                        padding_idx=i % 3, zero_padding_row=False, psw=False)
                                   for i in range(4)], "padding"))
    return out


@pytest.mark.mpi
def test_negative_controls_are_rejected(one_thread_per_rank, monkeypatch):
    for name, cases, patch in controls():
        with monkeypatch.context() as mp:
            if patch == "stale":  # outside lookups do not wait for the background part
                def before_read(self, ids, grad):
                    pass
                mp.setattr(la._Schedule, "before_read", before_read)
            if patch == "padding":  # padding entries counted in the bags
                real = F.embedding_bag

                def careless(*args, **kwargs):
                    kwargs["padding_idx"] = None
                    return real(*args, **kwargs)
                mp.setattr(emb_module, "F", types.SimpleNamespace(
                    embedding_bag=careless, embedding=F.embedding))
            worst, notes = run_cases(cases, None if patch else name)
        caught = [err > 1e-6 for err in worst]
        assert all(caught), f"control {name}: not rejected in " \
            f"{[c for c, k in zip(cases, caught) if not k]}"
