"""The ``commlib`` torch.distributed backend, op by op: every result against a numpy
reference that every rank computes for every rank (float64 values that sum exactly).
Every call names its group (``commlib_pg``: the commlib process group of all ranks), so the
tests hold whatever the default group of the session is."""
import importlib

import numpy as np
import pytest

import commlib
from helpers import rank_data

torch = pytest.importorskip("torch")
dist = torch.distributed


def data(r: int, numel: int = 7, seed: int = 0, kind: str = "sum") -> "torch.Tensor":
    return torch.from_numpy(rank_data(r, numel, "float64", kind, seed))


def ref(numel: int = 7, seed: int = 0, kind: str = "sum") -> np.ndarray:
    """Every rank's input, stacked: shape (world size, numel)."""
    return np.stack([rank_data(r, numel, "float64", kind, seed)
                     for r in range(dist.get_world_size())])


MODES = ["blocking", "wait", "future"]


def run(fn, mode: str, *args, **kwargs):
    """``fn(*args, **kwargs)`` blocking, or with ``async_op=True`` and completed through
    ``wait()`` or through ``get_future().wait()``."""
    if mode == "blocking":
        return fn(*args, **kwargs)
    work = fn(*args, async_op=True, **kwargs)
    if isinstance(work, torch.futures.Future):     # all_reduce_coalesced hands out one
        work.wait()
        assert work.done()
        return work
    if mode == "wait":
        assert work.wait()
    else:
        work.get_future().wait()
    assert work.is_completed()
    return work


REDUCTIONS = {"SUM": np.sum, "AVG": np.mean, "MIN": np.min, "MAX": np.max,
              "PRODUCT": np.prod}


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(REDUCTIONS))
@pytest.mark.parametrize("mode", MODES)
def test_all_reduce(commlib_pg, name, mode):
    r = dist.get_rank()
    kind = "product" if name == "PRODUCT" else "sum"
    t = data(r, kind=kind)
    work = run(dist.all_reduce, mode, t, op=getattr(dist.ReduceOp, name), group=commlib_pg)
    if mode != "blocking":
        assert work.get_future().value()[0] is t
    np.testing.assert_array_equal(t.numpy(), REDUCTIONS[name](ref(kind=kind), axis=0))


@pytest.mark.mpi
def test_many_async_operations_in_flight(commlib_pg):
    r, n = dist.get_rank(), dist.get_world_size()
    ts = [data(r, seed=20 + k) for k in range(6)]
    works = [dist.all_reduce(t, async_op=True, group=commlib_pg) for t in ts]
    outs = [torch.zeros(7, dtype=torch.float64) for _ in range(n)]
    works.append(dist.all_gather(outs, data(r, seed=30), async_op=True, group=commlib_pg))
    futures = [w.get_future() for w in works[::2]]
    for w in works[::-1]:
        w.wait()
    torch.futures.wait_all(futures)
    for k, t in enumerate(ts):
        np.testing.assert_array_equal(t.numpy(), ref(seed=20 + k).sum(0))
    np.testing.assert_array_equal(torch.stack(outs).numpy(), ref(seed=30))


@pytest.mark.mpi
@pytest.mark.parametrize("name,fn", [("BAND", np.bitwise_and), ("BOR", np.bitwise_or),
                                     ("BXOR", np.bitwise_xor)])
def test_all_reduce_bitwise(commlib_pg, name, fn):
    r, n = dist.get_rank(), dist.get_world_size()
    xs = [np.random.default_rng(k).integers(0, 1 << 40, 9) for k in range(n)]
    t = torch.from_numpy(xs[r].copy())
    dist.all_reduce(t, op=getattr(dist.ReduceOp, name), group=commlib_pg)
    np.testing.assert_array_equal(t.numpy(), fn.reduce(np.stack(xs)))


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_all_reduce_coalesced(commlib_pg, mode):
    r = dist.get_rank()
    a, b = data(r, 5, seed=1), data(r, 6, seed=2).reshape(2, 3)
    with pytest.warns(FutureWarning):
        run(dist.all_reduce_coalesced, mode, [a, b[:, 1]], op=dist.ReduceOp.MAX,
            group=commlib_pg)
    np.testing.assert_array_equal(a.numpy(), ref(5, seed=1).max(0))
    expected = ref(6, seed=2)[r].reshape(2, 3)
    expected[:, 1] = ref(6, seed=2).reshape(-1, 2, 3).max(0)[:, 1]
    np.testing.assert_array_equal(b.numpy(), expected)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_broadcast_and_reduce_from_every_root(commlib_pg, mode):
    r, n = dist.get_rank(), dist.get_world_size()
    for root in range(n):
        t = data(r, seed=root)
        run(dist.broadcast, mode, t, src=root, group=commlib_pg)
        np.testing.assert_array_equal(t.numpy(), ref(seed=root)[root])
        t = data(r, seed=root)
        run(dist.reduce, mode, t, dst=root, op=dist.ReduceOp.MAX, group=commlib_pg)
        expected = ref(seed=root).max(0) if r == root else ref(seed=root)[r]
        np.testing.assert_array_equal(t.numpy(), expected)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_all_gather_and_into_tensor(commlib_pg, mode):
    r, n = dist.get_rank(), dist.get_world_size()
    outs = [torch.zeros(7, dtype=torch.float64) for _ in range(n)]
    run(dist.all_gather, mode, outs, data(r), group=commlib_pg)
    np.testing.assert_array_equal(torch.stack(outs).numpy(), ref())
    flat = torch.zeros(n * 7, dtype=torch.float64)
    run(dist.all_gather_single, mode, flat, data(r), group=commlib_pg)
    np.testing.assert_array_equal(flat.numpy(), ref().ravel())
    flat = torch.zeros(n, 7, dtype=torch.float64)
    with pytest.warns(FutureWarning):                # the older name, same method
        run(dist.all_gather_into_tensor, mode, flat, data(r), group=commlib_pg)
    np.testing.assert_array_equal(flat.numpy(), ref())


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_reduce_scatter_list_and_tensor(commlib_pg, mode):
    r, n = dist.get_rank(), dist.get_world_size()
    full = ref(3 * n, seed=4)                      # (n ranks, n blocks of 3)
    mine = torch.from_numpy(full[r].copy())
    out = torch.zeros(3, dtype=torch.float64)
    run(dist.reduce_scatter, mode, out, list(mine.split(3)), group=commlib_pg)
    np.testing.assert_array_equal(out.numpy(), full.sum(0)[3 * r:3 * r + 3])
    out = torch.zeros(3, dtype=torch.float64)
    run(dist.reduce_scatter_single, mode, out, mine, op=dist.ReduceOp.MIN, group=commlib_pg)
    np.testing.assert_array_equal(out.numpy(), full.min(0)[3 * r:3 * r + 3])
    out = torch.zeros(3, dtype=torch.float64)
    with pytest.warns(FutureWarning):                # the older name, same method
        run(dist.reduce_scatter_tensor, mode, out, mine, op=dist.ReduceOp.AVG,
            group=commlib_pg)
    np.testing.assert_array_equal(out.numpy(), full.mean(0)[3 * r:3 * r + 3])


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_gather_and_scatter_every_root(commlib_pg, mode):
    r, n = dist.get_rank(), dist.get_world_size()
    for root in range(n):
        outs = [torch.zeros(7, dtype=torch.float64) for _ in range(n)] if r == root else None
        run(dist.gather, mode, data(r, seed=root), outs, dst=root, group=commlib_pg)
        if r == root:
            np.testing.assert_array_equal(torch.stack(outs).numpy(), ref(seed=root))
        out = torch.zeros(7, dtype=torch.float64)
        pieces = [data(k, seed=10 + root) for k in range(n)] if r == root else None
        run(dist.scatter, mode, out, pieces, src=root, group=commlib_pg)
        np.testing.assert_array_equal(out.numpy(), ref(seed=10 + root)[r])


def rows(i: int, j: int) -> int:
    """Rows rank i sends rank j in the uneven exchanges (some zero)."""
    return (2 * i + j) % 3


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_all_to_all_single_equal_and_uneven(commlib_pg, mode):
    r, n = dist.get_rank(), dist.get_world_size()
    inputs = [data(i, 4 * n, seed=5).reshape(2 * n, 2) for i in range(n)]
    out = torch.zeros(2 * n, 2, dtype=torch.float64)
    run(dist.all_to_all_single, mode, out, inputs[r], group=commlib_pg)
    expected = torch.cat([inputs[i][2 * r:2 * r + 2] for i in range(n)])
    np.testing.assert_array_equal(out.numpy(), expected.numpy())

    uneven = [data(i, 2 * sum(rows(i, j) for j in range(n)), seed=6).reshape(-1, 2)
              for i in range(n)]

    def block(i, j):
        start = sum(rows(i, k) for k in range(j))
        return uneven[i][start:start + rows(i, j)]

    out = torch.zeros(sum(rows(i, r) for i in range(n)), 2, dtype=torch.float64)
    run(dist.all_to_all_single, mode, out, uneven[r], [rows(i, r) for i in range(n)],
        [rows(r, j) for j in range(n)], group=commlib_pg)
    expected = torch.cat([block(i, r) for i in range(n)])
    np.testing.assert_array_equal(out.numpy(), expected.numpy())


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_all_to_all_lists_of_different_sizes(commlib_pg, mode):
    r, n = dist.get_rank(), dist.get_world_size()
    sent = [[data(i, 1 + rows(i, j), seed=7 + j) for j in range(n)] for i in range(n)]
    outs = [torch.zeros(1 + rows(i, r), dtype=torch.float64) for i in range(n)]
    run(dist.all_to_all, mode, outs, sent[r], group=commlib_pg)
    for i in range(n):
        np.testing.assert_array_equal(outs[i].numpy(), sent[i][r].numpy())


@pytest.mark.mpi
def test_point_to_point_ring(commlib_pg):
    r, n = dist.get_rank(), dist.get_world_size()
    right, left = (r + 1) % n, (r - 1) % n
    got = torch.zeros(7, dtype=torch.float64)
    # isend before irecv on every rank: non-blocking underneath, so no deadlock.
    ws = dist.isend(data(r, seed=8), right, tag=3, group=commlib_pg)
    wr = dist.irecv(got, left, tag=3, group=commlib_pg)
    wr.get_future().wait()
    ws.wait()
    np.testing.assert_array_equal(got.numpy(), ref(seed=8)[left])
    a, b = torch.zeros(7, dtype=torch.float64), torch.zeros(7, dtype=torch.float64)
    ops = [dist.P2POp(dist.isend, data(r, seed=9), right, group=commlib_pg),
           dist.P2POp(dist.irecv, a, left, group=commlib_pg),
           dist.P2POp(dist.isend, data(r, seed=10), left, group=commlib_pg),
           dist.P2POp(dist.irecv, b, right, group=commlib_pg)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    np.testing.assert_array_equal(a.numpy(), ref(seed=9)[left])
    np.testing.assert_array_equal(b.numpy(), ref(seed=10)[right])


@pytest.mark.mpi(min_size=2)
def test_blocking_send_recv_and_any_source(commlib_pg):
    r, n = dist.get_rank(), dist.get_world_size()
    if r == 0:
        seen = set()
        for _ in range(n - 1):
            t = torch.zeros(7, dtype=torch.float64)
            src = dist.recv(t, group=commlib_pg)       # from any source
            np.testing.assert_array_equal(t.numpy(), ref(seed=11)[src])
            seen.add(src)
        assert seen == set(range(1, n))
        for k in range(1, n):
            dist.send(data(0, seed=12), dst=k, group=commlib_pg)
    else:
        dist.send(data(r, seed=11), dst=0, group=commlib_pg)
        t = torch.zeros(7, dtype=torch.float64)
        assert dist.recv(t, src=0, group=commlib_pg) == 0
        np.testing.assert_array_equal(t.numpy(), ref(seed=12)[0])


@pytest.mark.mpi
def test_barrier_and_objects(commlib_pg):
    r, n = dist.get_rank(), dist.get_world_size()
    dist.barrier(group=commlib_pg)
    run(dist.barrier, "future", group=commlib_pg)
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r, "name": f"r{r}"}, group=commlib_pg)
    assert objs == [{"rank": k, "name": f"r{k}"} for k in range(n)]
    box = [f"from {n - 1}", r] if r == n - 1 else [None, None]
    dist.broadcast_object_list(box, src=n - 1, group=commlib_pg)
    assert box == [f"from {n - 1}", n - 1]


def members(n: int) -> list[int]:
    """Non-contiguous, out of order when possible: [2, 0] at 3 ranks, [3, 0, 2] at 4."""
    return {1: [0], 2: [1, 0], 3: [2, 0]}.get(n, [n - 1, 0, 2])


@pytest.mark.mpi
def test_sub_group_of_non_contiguous_ranks(commlib_pg):
    r, n = dist.get_rank(), dist.get_world_size()
    ranks = members(n)
    sub = dist.new_group(ranks, backend="commlib")
    if r not in ranks:
        assert sub == dist.GroupMember.NON_GROUP_MEMBER
        assert commlib.torch_backend.commlib_group(sub) is None
        return
    assert commlib.torch_backend.commlib_group(sub).ranks == tuple(sorted(ranks))
    t = data(r, seed=13)
    dist.all_reduce(t, group=sub)
    np.testing.assert_array_equal(t.numpy(), ref(seed=13)[sorted(ranks)].sum(0))
    t = data(r, seed=14)
    dist.broadcast(t, group=sub, group_src=len(ranks) - 1)
    np.testing.assert_array_equal(t.numpy(), ref(seed=14)[max(ranks)])
    outs = [torch.zeros(7, dtype=torch.float64) for _ in ranks]
    dist.all_gather(outs, data(r, seed=15), group=sub)
    np.testing.assert_array_equal(torch.stack(outs).numpy(), ref(seed=15)[sorted(ranks)])
    dist.destroy_process_group(sub)


@pytest.mark.mpi
def test_commlib_group_lookup(torch_groups):
    commlib_pg, gloo = torch_groups
    group = commlib.torch_backend.commlib_group(commlib_pg)
    assert isinstance(group, commlib.Group) and group.size == dist.get_world_size()
    assert commlib.torch_backend.commlib_group(gloo) is None
    assert commlib.torch_backend.commlib_group(None) is None


@pytest.mark.mpi
def test_unsupported_operations_name_themselves(commlib_pg):
    t = torch.ones(3, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="PREMUL_SUM"):
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0), group=commlib_pg)
    with pytest.raises(commlib.CommError, match="split_group is not supported"):
        commlib_pg.split_group([0])
    with pytest.raises(TypeError, match="ReduceOp.AVG with boolean"):
        dist.all_reduce(torch.ones(2, dtype=torch.bool), op=dist.ReduceOp.AVG, group=commlib_pg)
    with pytest.raises(ValueError, match="one tensor per rank"):
        dist.all_gather([torch.zeros(3)] * (dist.get_world_size() + 1), torch.zeros(3),
                        group=commlib_pg)


@pytest.mark.mpi
@pytest.mark.skipif(not importlib.import_module("commlib.base.accelerator")
                    .cuda_usable()["torch.cuda"], reason="no CUDA GPU for torch")
def test_cuda_tensors_and_ddp_on_the_gpu(commlib_pg):
    r, n = dist.get_rank(), dist.get_world_size()
    t = data(r).cuda()
    work = dist.all_reduce(t, async_op=True, group=commlib_pg)
    value = work.get_future().wait()
    assert value[0].device.type == "cuda"
    np.testing.assert_array_equal(t.cpu().numpy(), ref().sum(0))
    out = torch.zeros(2 * n, dtype=torch.float64, device="cuda")
    dist.all_to_all_single(out, data(r, 2 * n, seed=16).cuda(), group=commlib_pg)
    expected = np.concatenate([ref(2 * n, seed=16)[i][2 * r:2 * r + 2] for i in range(n)])
    np.testing.assert_array_equal(out.cpu().numpy(), expected)
    torch.manual_seed(0)
    net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(6, 3).double().cuda(),
                                                    process_group=commlib_pg)
    net(data(r, 12).reshape(2, 6).cuda()).sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in net.parameters()]).cpu().numpy()
    replicas = commlib.allgather(grads)
    np.testing.assert_array_equal(replicas, np.broadcast_to(grads, replicas.shape))


@pytest.mark.mpi
@pytest.mark.parametrize("count", ["ranks", "other"])
def test_all_gather_coalesced_lists_are_rank_major_like_gloo(torch_groups, count):
    """torch's output lists are [rank][tensor]: with as many tensors as ranks a transposed
    result has the right shapes (silently wrong), so compare values, and against gloo."""
    world, gloo = torch_groups
    r, n = dist.get_rank(), dist.get_world_size()
    k = n if count == "ranks" else n + 1
    results = []
    for pg in (world, gloo):
        inputs = [torch.full((2,), 10.0 * i + r, dtype=torch.float64) for i in range(k)]
        outs = [[torch.zeros(2, dtype=torch.float64) for _ in range(k)] for _ in range(n)]
        dist.all_gather_coalesced(outs, inputs, group=pg)
        results.append([[o.tolist() for o in row] for row in outs])
    expected = [[[10.0 * i + q] * 2 for i in range(k)] for q in range(n)]
    assert results[0] == expected
    assert results[0] == results[1]


def truncated_mean(values: np.ndarray, dtype: str) -> np.ndarray:
    """NCCL's ncclAvg on integers: the sum in the dtype (wrapping), divided by the number
    of ranks rounding toward zero (numpy's integer sum wraps as C's does)."""
    total = values.astype(dtype).sum(axis=0, dtype=dtype)
    n = values.shape[0]
    return np.array([int(s) // n if s >= 0 else -((-int(s)) // n) for s in total],
                    dtype=dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["int64", "int32", "int8", "uint8"])
def test_integer_average_has_nccl_semantics(commlib_pg, dtype):
    """ReduceOp.AVG on integers (what Lightning's sync_dist sends): the truncated mean of
    the wrapped sum, on every rank, in every reducing collective, 20 generated cases."""
    r, n = dist.get_rank(), dist.get_world_size()
    info = np.iinfo(dtype)
    tdtype = getattr(torch, dtype)
    for seed in range(20):
        rng = np.random.default_rng(seed)
        low, high = (info.min, info.max) if seed % 4 == 0 else (-9 if info.min else 0, 9)
        values = rng.integers(low, high, size=(n, 7), endpoint=True, dtype=np.int64)
        values = values.astype(dtype)
        expected = truncated_mean(values, dtype)
        t = torch.from_numpy(values[r].copy())
        work = dist.all_reduce(t, op=dist.ReduceOp.AVG, group=commlib_pg,
                               async_op=seed % 2 == 1)
        if seed % 2:
            work.wait()
        assert t.dtype == tdtype
        np.testing.assert_array_equal(t.numpy(), expected, err_msg=f"all_reduce seed {seed}")
        t = torch.from_numpy(values[r].copy())
        dist.reduce(t, dst=n - 1, op=dist.ReduceOp.AVG, group=commlib_pg)
        np.testing.assert_array_equal(t.numpy(), expected if r == n - 1 else values[r],
                                      err_msg=f"reduce seed {seed}")
        big = np.tile(values, (1, n))                  # n blocks of 7 per rank
        out = torch.zeros(7, dtype=tdtype)
        dist.reduce_scatter_tensor(out, torch.from_numpy(big[r].copy()),
                                   op=dist.ReduceOp.AVG, group=commlib_pg)
        np.testing.assert_array_equal(out.numpy(), expected,
                                      err_msg=f"reduce_scatter_tensor seed {seed}")
    if n > 1:   # the check can fail: a plain sum is not the average
        assert not np.array_equal(values.astype(dtype).sum(0, dtype=dtype), expected)


def random_sparse(seed: int, rank: int) -> "torch.Tensor":
    """A sparse COO float64 tensor, the same shape on every rank, with duplicates (not
    coalesced), sometimes empty, with 1-3 sparse and 0-2 dense dimensions."""
    g = np.random.default_rng(seed * 131 + rank)
    shape_rng = np.random.default_rng(seed)
    sparse_dims = 1 + seed % 3
    dense_shape = list(shape_rng.integers(1, 4, size=seed % 3))
    shape = list(shape_rng.integers(2, 6, size=sparse_dims)) + dense_shape
    nnz = 0 if (seed + rank) % 7 == 3 else int(g.integers(1, 9))
    indices = np.stack([g.integers(0, s, size=nnz) for s in shape[:sparse_dims]])
    values = g.integers(-5, 6, size=[nnz] + dense_shape).astype(np.float64)
    return torch.sparse_coo_tensor(torch.from_numpy(indices), torch.from_numpy(values),
                                   shape)


@pytest.mark.mpi
def test_sparse_all_reduce_equals_gloo(torch_groups):
    """40 generated sparse tensors: commlib's result equals gloo's, in place, coalesced."""
    world, gloo = torch_groups
    r = dist.get_rank()
    for seed in range(40):
        ours, theirs = random_sparse(seed, r), random_sparse(seed, r)
        mine = ours.to_dense().clone()
        dist.all_reduce(ours, group=world)
        dist.all_reduce(theirs, group=gloo)
        assert ours.is_sparse and ours.is_coalesced(), f"seed {seed}"
        got, want = ours.to_dense(), theirs.to_dense()
        assert torch.equal(got, want), f"seed {seed}: {got} vs gloo {want}"
        assert torch.equal(ours.coalesce().indices(), theirs.coalesce().indices())
        if dist.get_world_size() > 1 and seed == 1:
            assert not torch.equal(got, mine)     # the check can fail
    t = random_sparse(1, r)
    with pytest.raises(NotImplementedError, match="sparse tensor with ReduceOp.MAX"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world)
    with pytest.raises(NotImplementedError, match="broadcast of a torch.sparse_coo"):
        dist.broadcast(t, src=0, group=world)


@pytest.mark.mpi
def test_sparse_all_reduce_refuses_mismatched_sizes_on_every_rank(commlib_pg):
    r = dist.get_rank()
    t = torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.int64), torch.ones(1),
                                [4 + (r == dist.get_world_size() - 1)])
    if dist.get_world_size() == 1:
        return
    with pytest.raises(ValueError, match="differ in their size"):
        dist.all_reduce(t, group=commlib_pg)


PROFILED = [("all_reduce", lambda t, pg, n, a: dist.all_reduce(t, group=pg, async_op=a)),
            ("broadcast", lambda t, pg, n, a: dist.broadcast(t, src=0, group=pg, async_op=a)),
            ("all_gather", lambda t, pg, n, a: dist.all_gather(
                [torch.zeros_like(t) for _ in range(n)], t, group=pg, async_op=a)),
            ("reduce", lambda t, pg, n, a: dist.reduce(t, dst=0, group=pg, async_op=a)),
            ("all_to_all", lambda t, pg, n, a: dist.all_to_all_single(
                torch.zeros(3 * n, dtype=t.dtype), torch.zeros(3 * n, dtype=t.dtype),
                group=pg, async_op=a))]


@pytest.mark.mpi
def test_profiler_records_one_event_per_operation_like_gloo(torch_groups):
    """Under torch.profiler: one asynchronous ``<backend>:<op>`` event per operation,
    with the input shapes, for commlib as for gloo (blocking and async_op calls)."""
    world, gloo = torch_groups
    n = dist.get_world_size()
    found = {}
    for pg, backend in ((world, "commlib"), (gloo, "gloo")):
        with torch.profiler.profile(record_shapes=True) as prof:
            t = torch.ones(3, 2, dtype=torch.float64)
            for asynchronous in (False, True):
                for _, call in PROFILED:
                    work = call(t, pg, n, asynchronous)
                    if asynchronous:
                        work.wait()
            work = dist.all_reduce(torch.ones(4, dtype=torch.float64), group=pg,
                                   async_op=True)
            work.wait()
        events = {}
        for e in prof.events():
            if e.name.startswith(backend + ":"):
                events.setdefault(e.name.split(":")[1], []).append(
                    (e.is_async, e.input_shapes, e.count))
        found[backend] = events
    ours, theirs = found["commlib"], found["gloo"]
    assert sorted(ours) == sorted({name for name, _ in PROFILED}), ours
    for name, _ in PROFILED:
        assert ours[name] == theirs.get(name, ours[name]), (name, ours, theirs)
    assert ours["all_reduce"] == [(True, [[3, 2]], 1)] * 2 + [(True, [[4]], 1)]
    assert all(a for evs in ours.values() for a, _, _ in evs)


@pytest.mark.mpi(min_size=2)
def test_profiler_records_send_and_recv(commlib_pg):
    r, n = dist.get_rank(), dist.get_world_size()
    with torch.profiler.profile(record_shapes=True) as prof:
        if r == 0:
            dist.send(torch.ones(2, 5), dst=n - 1, group=commlib_pg)
        elif r == n - 1:
            dist.recv(torch.zeros(2, 5), src=0, group=commlib_pg)
    names = [(e.name, e.input_shapes, e.is_async) for e in prof.events()
             if e.name.startswith("commlib:")]
    expected = {0: [("commlib:send", [[2, 5]], True)],
                n - 1: [("commlib:recv", [[2, 5]], True)]}.get(r, [])
    assert names == expected
