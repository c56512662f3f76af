"""commlib.horovod's collectives against expected values each rank computes itself.

A port of the semantics of Horovod's test/parallel/test_torch.py (our own tests): every
rank's input is a deterministic function of (rank, case), so every rank builds all inputs
and the expected result with plain torch in Horovod's arithmetic (prescale before and
postscale after the sum, integer averages truncated, float16 scaled in float32). Many
cases per test function, each failure naming its case. Runs at 1, 2, 3 and 4 ranks.
"""
from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import commlib.horovod as hvd  # noqa: E402
from commlib.horovod.adasum import adasum_combine  # noqa: E402

pytestmark = pytest.mark.mpi
DTYPES = [torch.uint8, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64]
FLOATS = (torch.float16, torch.float32, torch.float64)


@pytest.fixture(scope="module", autouse=True)
def horovod(one_thread_per_rank):
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    hvd.init()
    yield
    hvd.shutdown()


def data(r: int, shape: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 97 + r)
    lo, hi = (0, 20) if dtype == torch.uint8 else (-50, 50)
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def scaled(t: torch.Tensor, f: float) -> torch.Tensor:
    """Horovod's ScaleBuffer: float64 for integers (truncated), float32 for float16/32."""
    if f == 1.0:
        return t
    if t.dtype in (torch.float16, torch.float32):
        return (t.float() * torch.tensor(np.float32(f))).to(t.dtype)
    return (t.double() * f).to(t.dtype)


def same(got: torch.Tensor, want: torch.Tensor, case: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{case}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
    if got.dtype == torch.float16:
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=0.1,
                                   msg=lambda m: f"{case}: {m}")
    else:
        torch.testing.assert_close(got, want, rtol=1e-6 if got.is_floating_point() else 0,
                                   atol=0, msg=lambda m: f"{case}: {m}")


def raises_everywhere(fn, exc, case: str) -> None:
    try:
        fn()
    except exc:
        return
    raise AssertionError(f"{case}: no {exc} on rank {hvd.rank()}")


def test_allreduce_family():
    n, me = hvd.size(), hvd.rank()
    cases = 0
    for (dtype, dim, op, pre, post), inplace in itertools.product(
            itertools.product(DTYPES, (0, 2), (hvd.Sum, hvd.Average, hvd.Min, hvd.Max),
                              (1.0, 0.5), (1.0, 3.0)), (False, True)):
        if (pre != 1.0 or post != 1.0) and op in (hvd.Min, hvd.Max) or (pre == 1.0) != (post == 1.0):
            continue
        seed = cases
        shape = (5,) * dim
        xs = [data(r, shape, dtype, seed) for r in range(n)]
        scaled_in = [scaled(x, pre) for x in xs]
        if op in (hvd.Sum, hvd.Average):
            acc = scaled_in[0].clone()
            for x in scaled_in[1:]:
                acc = acc + x
            want = scaled(acc, post / n if op == hvd.Average else post)
        else:
            stack = torch.stack([x.double() for x in scaled_in])
            want = (stack.min(0).values if op == hvd.Min else stack.max(0).values).to(dtype)
            want = scaled(want, post)
        case = f"allreduce {dtype} dim={dim} op={op} pre={pre} post={post} inplace={inplace}"
        mine = xs[me].clone()
        if inplace:
            got = hvd.allreduce_(mine, op=op, prescale_factor=pre, postscale_factor=post,
                                 name=f"ar{cases}")
            assert got is mine, case
        else:
            got = hvd.allreduce(mine, op=op, prescale_factor=pre, postscale_factor=post)
            assert torch.equal(mine, xs[me]), f"{case}: input modified"
        same(got, want, case)
        cases += 1
    # grouped, async, deprecated average=, an op order that differs between ranks
    xs = [[data(r, (4, 3), torch.float64, 900 + k) for k in range(3)] for r in range(n)]
    h = hvd.grouped_allreduce_async([x.clone() for x in xs[me]], average=False, name="grp")
    outs = hvd.synchronize(h)
    for k in range(3):
        same(outs[k], sum(x[k] for x in xs), f"grouped_allreduce tensor {k}")
    names = [f"ooo{k}" for k in range(5)]
    order = names if me % 2 == 0 else names[::-1]
    handles = {nm: hvd.allreduce_async(torch.full((3,), float(me + int(nm[-1]))), name=nm,
                                       op=hvd.Sum) for nm in order}
    for nm in names:
        want = torch.full((3,), float(sum(r + int(nm[-1]) for r in range(n))))
        same(hvd.synchronize(handles[nm]), want, f"out-of-order {nm}")
    big = torch.ones(1 << 22)
    h = hvd.allreduce_async(big, op=hvd.Sum)
    assert not hvd.poll(h), "poll() was True right after submitting 16 MB: not asynchronous"
    same(hvd.synchronize(h), torch.full((1 << 22,), float(n)), "async 16 MB")
    with pytest.raises(ValueError):
        hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum)
    assert cases == 144


def test_tiny_blocking_allreduce_is_one_collective():
    """Latency: a tiny blocking allreduce (named, unnamed, in place, every op) costs one
    collective - its negotiation round's allgather carries the data - on every rank, and
    gives Horovod's result; a larger one still negotiates, then reduces (two)."""
    from commlib.base import accounting
    n, me = hvd.size(), hvd.rank()
    hvd.barrier()
    before = accounting.stats()
    cases = 0
    for dtype, op, name in itertools.product((torch.float32, torch.int64, torch.uint8),
                                             (hvd.Sum, hvd.Average, hvd.Max, hvd.Product),
                                             ("tiny", None)):
        xs = [data(r, (3,), dtype, 300 + cases) % 5 + 1 for r in range(n)]
        if op in (hvd.Sum, hvd.Average):
            acc = xs[0].clone()
            for x in xs[1:]:
                acc = acc + x
            want = scaled(acc, 1.0 / n) if op == hvd.Average else acc
        elif op == hvd.Max:
            want = torch.stack(xs).max(0).values
        else:
            want = xs[0].clone()
            for x in xs[1:]:
                want = want * x
        case = f"tiny allreduce {dtype} op={op} name={name}"
        mine = xs[me].clone()
        same(hvd.allreduce(mine, op=op, name=name), want, case)
        same(hvd.allreduce_(mine, op=op, name=None if name is None else name + "_"), want,
             case + " in place")
        cases += 2
    after = accounting.stats()
    calls = sum(v["calls"] - before.get(k, {}).get("calls", 0) for k, v in after.items())
    assert calls == cases, f"{cases} tiny blocking allreduces made {calls} collectives"
    big = torch.ones(1000)
    before = accounting.stats()
    same(hvd.allreduce(big, op=hvd.Sum), torch.full((1000,), float(n)), "1000 floats")
    after = accounting.stats()
    calls = sum(v["calls"] - before.get(k, {}).get("calls", 0) for k, v in after.items())
    assert calls == 2, f"a 4 KB allreduce made {calls} collectives, expected 2"


def test_express_lane_mismatches_after_a_warm_cache():
    """The express lane of tiny blocking allreduces announces a cached (name, metadata)
    as a 4-byte id: after both variants of a name ran on every rank (both cached), one rank
    switching dtype, op or scale factor (same name, same shape, same byte count) still
    raises on every rank, and the name works again afterwards."""
    n, me = hvd.size(), hvd.rank()
    variants = [dict(dtype=torch.float32, op=hvd.Sum), dict(dtype=torch.int32, op=hvd.Sum),
                dict(dtype=torch.float32, op=hvd.Max),
                dict(dtype=torch.float32, op=hvd.Sum, prescale_factor=2.0)]
    for v in variants:   # warm: every variant ran (and is cached) on every rank
        kw = {k: x for k, x in v.items() if k != "dtype"}
        for _ in range(2):
            got = hvd.allreduce(torch.ones(4, dtype=v["dtype"]), name="warm", **kw)
            pre = v.get("prescale_factor", 1.0)
            want = torch.full((4,), (n if v["op"] == hvd.Sum else 1) * pre).to(v["dtype"])
            same(got, want, f"warm {v}")
    if n == 1:
        return
    cases = 0
    for a, b in itertools.combinations(variants, 2):
        v = a if me == 0 else b
        kw = {k: x for k, x in v.items() if k != "dtype"}
        raises_everywhere(lambda: hvd.allreduce(torch.ones(4, dtype=v["dtype"]), name="warm",
                                                **kw),
                          RuntimeError, f"rank 0 {a}, others {b}")
        # and a fresh (uncached) name with a dtype mismatch of the same byte count
        raises_everywhere(lambda: hvd.allreduce(
            torch.ones(4, dtype=torch.float32 if me == 0 else torch.int32),
            name=f"fresh{cases}"), RuntimeError, f"fresh name {cases}")
        same(hvd.allreduce(torch.ones(4), name="warm", op=hvd.Sum), torch.full((4,), float(n)),
             f"after mismatch {a} {b}")
        cases += 1
    assert cases == 6


def test_gather_broadcast_alltoall_reducescatter():
    n, me = hvd.size(), hvd.rank()
    cases = 0
    for dtype, dim in itertools.product(DTYPES, (1, 2, 3)):
        rows = [r + 1 for r in range(n)]
        xs = [data(r, (rows[r],) + (3,) * (dim - 1), dtype, 50 + cases) for r in range(n)]
        same(hvd.allgather(xs[me]), torch.cat(xs), f"allgather {dtype} dim={dim}")
        for root in range(n):
            ys = [data(r, (4,) * dim, dtype, 70 + cases) for r in range(n)]
            same(hvd.broadcast(ys[me], root), ys[root], f"broadcast root={root} {dtype}")
            mine = ys[me].clone()
            hvd.broadcast_(mine, root)
            same(mine, ys[root], f"broadcast_ root={root} {dtype}")
        # alltoall with uneven splits: rank r sends (r + j) % 3 rows to rank j
        splits = [[(r + j) % 3 for j in range(n)] for r in range(n)]
        zs = [data(r, (sum(splits[r]),) + (2,) * (dim - 1), dtype, 80 + cases)
              for r in range(n)]

        def block(r, j):
            o = sum(splits[r][:j])
            return zs[r][o:o + splits[r][j]]

        out, received = hvd.alltoall(zs[me], splits=splits[me])
        same(out, torch.cat([block(r, me) for r in range(n)]), f"alltoall {dtype} dim={dim}")
        assert received.tolist() == [splits[r][me] for r in range(n)], f"alltoall splits {dtype}"
        eq = [data(r, (2 * n,) + (2,) * (dim - 1), dtype, 90 + cases) for r in range(n)]
        same(hvd.alltoall(eq[me]), torch.cat([eq[r][2 * me:2 * me + 2] for r in range(n)]),
             f"alltoall equal {dtype}")
        # reducescatter, uneven first dimension: the first dim0 % n ranks get a row more
        d0 = 2 * n + 1
        ws = [data(r, (d0,) + (3,) * (dim - 1), dtype, 95 + cases) for r in range(n)]
        sizes = [d0 // n + (1 if r < d0 % n else 0) for r in range(n)]
        lo = sum(sizes[:me])
        total = ws[0].clone()
        for w in ws[1:]:
            total = total + w
        for op in (hvd.Sum, hvd.Average):
            want = total if op == hvd.Sum else scaled(total, 1.0 / n)
            same(hvd.reducescatter(ws[me], op=op), want[lo:lo + sizes[me]],
                 f"reducescatter {dtype} dim={dim} op={op}")
        cases += 1
    g = hvd.grouped_allgather([torch.full((me + 1,), float(me)), torch.full((2, 2), float(me))])
    same(g[0], torch.cat([torch.full((r + 1,), float(r)) for r in range(n)]), "grouped_allgather 0")
    same(g[1], torch.cat([torch.full((2, 2), float(r)) for r in range(n)]), "grouped_allgather 1")
    rs = hvd.grouped_reducescatter([torch.ones(n, 2), torch.ones(2 * n)], op=hvd.Sum)
    same(rs[0], torch.full((1, 2), float(n)), "grouped_reducescatter 0")
    same(rs[1], torch.full((2,), float(n)), "grouped_reducescatter 1")
    assert hvd.broadcast_object({"rank": me, "x": [1, 2]} if me == 0 else None, 0) == \
        {"rank": 0, "x": [1, 2]}
    assert hvd.allgather_object(("r", me)) == [("r", r) for r in range(n)]
    sp = torch.sparse_coo_tensor(torch.tensor([[me]]), torch.tensor([1.0]), (n,))
    dense = hvd.sparse_allreduce_async(sp, name="sparse", op=hvd.Sum)().to_dense()
    same(dense, torch.ones(n), "sparse_allreduce_async")
    assert cases == 18


def test_errors_are_raised_on_every_rank():
    n, me = hvd.size(), hvd.rank()
    if n > 1:
        bad = [
            ("shape", lambda: hvd.allreduce(torch.ones(3 + me))),
            ("ndim", lambda: hvd.allreduce(torch.ones(6) if me == 0 else torch.ones(2, 3))),
            ("dtype", lambda: hvd.allreduce(torch.ones(3, dtype=torch.float32 if me % 2 else
                                                       torch.float64))),
            ("op", lambda: hvd.allreduce(torch.ones(3), op=hvd.Sum if me else hvd.Max)),
            ("root", lambda: hvd.broadcast(torch.ones(3), me, name="root_mismatch")),
            ("allgather trailing", lambda: hvd.allgather(torch.ones(2, 2 + me))),
            ("kind", lambda: (hvd.allreduce if me else hvd.allgather)(torch.ones(3), name="k")),
            ("reducescatter shape", lambda: hvd.reducescatter(torch.ones(n * (me + 1)))),
        ]
        for what, fn in bad:
            raises_everywhere(fn, RuntimeError, f"mismatched {what}")
        hvd.barrier()
        # rank 0's second "dup" comes while its first is surely pending: the others
        # submit theirs only after the barrier, which rank 0 enters after its check
        if me == 0:
            h = hvd.allreduce_async(torch.ones(2), name="dup")
            with pytest.raises(ValueError):
                hvd.allreduce_async(torch.ones(2), name="dup")
            hvd.barrier()
        else:
            hvd.barrier()
            h = hvd.allreduce_async(torch.ones(2), name="dup")
        hvd.synchronize(h)
        # join: the last rank joins first; the others' allreduces average its zeros in
        first = n - 1
        if me == first:
            last = hvd.join()
        else:
            x = torch.full((4,), float(me + 1))
            got = hvd.allreduce(x, op=hvd.Average, name="after_join")
            same(got, torch.full((4,), sum(r + 1.0 for r in range(n - 1)) / n), "join average")
            raises_everywhere(lambda: hvd.allgather(torch.ones(2)), RuntimeError,
                              "allgather after join")
            last = hvd.join()
        assert last != first, f"join returned the first rank to join ({last})"
        assert hvd.allgather_object(last) == [last] * n, "join returned different ranks"
    for what, fn in [
        ("alltoall equal split", lambda: hvd.alltoall(torch.ones(n + 1)) if n > 1 else
         hvd.alltoall(torch.ones(1), splits=[2])),
        ("alltoall splits sum", lambda: hvd.alltoall(torch.ones(n - 1), torch.ones(n, dtype=torch.int32))),
        ("alltoall splits dtype", lambda: hvd.alltoall(torch.ones(n), torch.ones(n))),
        ("reducescatter scalar", lambda: hvd.reducescatter(torch.tensor(1.0))),
        ("broadcast root out of range", lambda: hvd.broadcast(torch.ones(1), n)),
    ]:
        raises_everywhere(fn, ValueError, what)
    raises_everywhere(lambda: hvd.reducescatter(torch.ones(n), op=hvd.Adasum), RuntimeError,
                      "reducescatter Adasum")
    with pytest.raises(ValueError):
        hvd.allreduce(torch.ones(4, 4).t())   # not contiguous
    hvd.barrier()


def test_process_sets_adasum_autograd():
    n, me = hvd.size(), hvd.rank()
    if n > 1:
        evens = hvd.add_process_set([r for r in range(n) if r % 2 == 0])
        odds = hvd.add_process_set([r for r in range(n) if r % 2 == 1])
        mine, other = (evens, odds) if me % 2 == 0 else (odds, evens)
        assert mine.included() and not other.included()
        assert mine.rank() == mine.ranks.index(me) and mine.size() == len(mine.ranks)
        got = hvd.allreduce(torch.full((3,), float(me)), op=hvd.Sum, process_set=mine)
        same(got, torch.full((3,), float(sum(mine.ranks))), "allreduce on a process set")
        got = hvd.allgather(torch.full((1,), float(me)), process_set=mine)
        same(got, torch.tensor([float(r) for r in mine.ranks]), "allgather on a process set")
        root = mine.ranks[-1]
        same(hvd.broadcast(torch.full((2,), float(me)), root, process_set=mine),
             torch.full((2,), float(root)), "broadcast on a process set (world root)")
        hvd.barrier(process_set=mine)
        with pytest.raises(ValueError):
            hvd.allreduce(torch.ones(1), process_set=other)
        with pytest.raises(ValueError):
            hvd.add_process_set(list(mine.ranks))   # duplicate
        assert hvd.remove_process_set(evens) and hvd.remove_process_set(odds)
        assert not hvd.remove_process_set(hvd.global_process_set)
    # Adasum, any world size, against an independent float64 tree
    for k in range(3):
        vs = [torch.randn(7, generator=torch.Generator().manual_seed(300 + 10 * k + r),
                          dtype=torch.float64) for r in range(n)]
        level = [v.numpy() for v in vs]
        while len(level) > 1:
            nxt = []
            for a, b in zip(level[0::2], level[1::2]):
                d = a @ b
                nxt.append((1 - d / (2 * (a @ a))) * a + (1 - d / (2 * (b @ b))) * b)
            level = nxt + ([level[-1]] if len(level) % 2 else [])
        got = hvd.allreduce(vs[me], op=hvd.Adasum)
        np.testing.assert_allclose(got.numpy(), level[0], rtol=1e-12, err_msg=f"adasum {k}")
    two = [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0])]
    assert torch.equal(adasum_combine(two), torch.tensor([1.0, 0.0]))  # parallel: averaged
    # autograd, Horovod's backward definitions
    x = torch.full((3, 2), float(me + 1), dtype=torch.float64, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum).sum().backward()
    same(x.grad, torch.full((3, 2), float(n), dtype=torch.float64), "allreduce grad")
    x = torch.full((me + 1, 2), float(me), dtype=torch.float64, requires_grad=True)
    rows = sum(r + 1 for r in range(n))
    weights = torch.arange(rows, dtype=torch.float64).unsqueeze(1).expand(rows, 2)
    (hvd.allgather(x) * weights).sum().backward()
    lo = sum(r + 1 for r in range(me))
    same(x.grad, weights[lo:lo + me + 1], "allgather grad")
    for root in range(n):
        x = torch.ones(4, dtype=torch.float64, requires_grad=True)
        hvd.broadcast(x, root).sum().backward()
        same(x.grad, torch.full((4,), 1.0 if me == root else 0.0, dtype=torch.float64),
             f"broadcast grad root={root}")
    x = torch.ones(2 * n, 3, dtype=torch.float64, requires_grad=True)
    (hvd.reducescatter(x, op=hvd.Sum) * (me + 1)).sum().backward()
    want = torch.cat([torch.full((2, 3), float(n * (r + 1)), dtype=torch.float64)
                      for r in range(n)])
    same(x.grad, want, "reducescatter grad")
    x = torch.arange(2.0 * n, dtype=torch.float64, requires_grad=True)
    out, _ = hvd.alltoall(x, splits=[2] * n)
    (out * (me + 1)).sum().backward()
    same(x.grad, torch.cat([torch.full((2,), r + 1.0, dtype=torch.float64) for r in range(n)]),
         "alltoall grad")


def test_basics():
    n, me = hvd.size(), hvd.rank()
    assert hvd.is_initialized() and 0 <= me < n
    assert 0 <= hvd.local_rank() < hvd.local_size() <= n
    assert 0 <= hvd.cross_rank() < hvd.cross_size() and hvd.cross_size() * 1 <= n
    assert hvd.mpi_built() and hvd.mpi_enabled() and not hvd.gloo_built()
    assert hvd.nccl_built() == 0 and not hvd.ccl_built() and not hvd.ddl_built()
    assert hvd.cuda_built() == torch.cuda.is_available()
    assert isinstance(hvd.mpi_threads_supported(), bool)
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    c, ctx = hvd.Compression.fp16.compress(torch.ones(2, dtype=torch.float64))
    assert c.dtype == torch.float16 and hvd.Compression.fp16.decompress(c, ctx).dtype == torch.float64
    # ElasticSampler (Horovod 0.28.1): the epoch's permutation less the processed samples,
    # padded to a multiple of the size, dealt rank::size
    import random
    n, me = hvd.size(), hvd.rank()
    sampler = hvd.elastic.ElasticSampler(list(range(11)), shuffle=True, seed=5)
    sampler.set_epoch(2)
    sampler.record_batch(0, 2)
    assert sampler.state_dict() == {"epoch": 2, "processed_num": 2 * n}
    perm = list(range(11))
    random.Random(7).shuffle(perm)
    rest = perm[2 * n:]
    rest += rest[:(-len(rest)) % n]   # padded to a multiple of n with its first samples
    assert len(list(sampler)) == -(-11 // n), "record_batch re-dealt before a reset"
    sampler.reset()   # (TorchState's restore and sync do it)
    assert list(sampler) == rest[me::n] and len(sampler) == len(rest) // n
    twin = hvd.elastic.ElasticSampler(list(range(11)), shuffle=True, seed=5)
    twin.load_state_dict(sampler.state_dict())
    assert list(twin) == list(sampler)
    from commlib.horovod.run import command
    cmd = command(["-np", "4", "-H", "a:2,b:2", "python", "train.py", "--lr", "1"])
    assert cmd[1:] == ["-n", "4", "-hosts", "a:2,b:2", "python", "train.py", "--lr", "1"]
