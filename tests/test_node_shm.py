"""The shared-memory tier inside a node (``commlib.primitives.node_shm``, issue 33 §1).

Multi-rank tests (``mpiexec -n N python -m pytest --with-mpi``, N in 1-4) run each
collective through shared memory (``COMMLIB_SHM=1``) and through MPI (``COMMLIB_SHM=0``) on
the same inputs, for every dtype and valid ReduceOp and every size class (empty, tiny,
below one step, several steps with a ragged last one), on a group whose window has 4 KiB
halves (so that several steps are cheap), and compare: integer and bool results exactly,
floating-point ones within reassociation (and exactly where the inputs make every partial
sum exact); the shared-memory result must be bitwise the same on every rank. Each call
checks ``node_shm.COUNTS``: the shared-memory path ran exactly when asked, never with
``COMMLIB_SHM=0`` (the negative control), never asynchronously, and with ``auto`` from the
crossover size. The serial session kills a rank inside a shared-memory collective in
fault-tolerant mode: the survivors must raise PeerFailure, shrink and go on through shared
memory, nothing may hang or stay in ``/dev/shm``; with fault tolerance off the same kill
must end the job (control).
"""
from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

import commlib
from commlib import ReduceOp
from commlib.base.options import options
from commlib.base.reduce_ops import mpi_op
from commlib.primitives import node_shm
from helpers import mpi_impl, serial_only, small_window_group

torch = pytest.importorskip("torch")

NUMPY_DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
                "uint64", "float16", "float32", "float64", "complex64", "complex128"]
TORCH_DTYPES = ["bfloat16", "float16", "float32", "int64"]
CASES = [("numpy", d) for d in NUMPY_DTYPES] + [("torch", d) for d in TORCH_DTYPES]
HALF = 4096  # bytes of a window half in the test group
SIZES = ["empty", "one", "tiny", "below", "steps"]
OPS = list(ReduceOp)
HALF_FLOATS = ("float16", "bfloat16")


def itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


def numel(size: str, dtype: str) -> int:
    per = HALF // itemsize(dtype)
    return {"empty": 0, "one": 1, "tiny": 5, "below": per // 3, "steps": 3 * per + 7}[size]


@pytest.fixture(scope="module")
def group():
    """A group over every rank whose window has 4 KiB halves (made on its first use,
    while SEGMENT_BYTES says so), freed after the module."""
    yield from small_window_group(HALF)


@pytest.fixture
def setting():
    saved = options.shm
    yield
    options.shm = saved


def values(rank: int, count: int, dtype: str, op: ReduceOp, seed: int) -> np.ndarray:
    """Rank ``rank``'s input as float64/complex/int values every rank can compute.

    Half floats: multiples of 1/8 in [-4, 4] (every partial sum of 4 ranks exact in 16
    bits); PRODUCT: values in {-2, -1, 1, 2} (floats) or small ones (integers, which wrap
    like MPI's); integers: their full range for the bitwise ops, small ones else; float32
    and float64: uniform in [-1, 1) (reassociation shows)."""
    rng = np.random.default_rng([seed, rank, count, len(dtype)])
    if dtype == "bool":
        return rng.integers(0, 2, count).astype(bool)
    if op is ReduceOp.PRODUCT:
        if dtype.startswith("u"):
            return rng.integers(1, 4, count).astype(dtype)
        return rng.choice(np.array([-2, -1, 1, 2]), count).astype(np.float64)
    if dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR, ReduceOp.MIN, ReduceOp.MAX):
            return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
        return rng.integers(max(info.min, -100), 100, count, dtype=dtype)
    if dtype in HALF_FLOATS:
        return rng.integers(-32, 33, count) / 8.0
    real = rng.uniform(-1, 1, count)
    if dtype.startswith("complex"):
        return real + 1j * rng.uniform(-1, 1, count)
    return real


def make(vals: np.ndarray, kind: str, dtype: str):
    if kind == "numpy":
        return vals.astype(dtype) if vals.dtype != np.dtype(dtype) else vals.copy()
    return torch.tensor(vals, dtype=getattr(torch, dtype))


def as_numpy(obj) -> np.ndarray:
    if isinstance(obj, np.ndarray):
        return obj
    if obj.dtype == torch.bfloat16:
        return obj.float().numpy()
    return obj.numpy()


def same_everywhere(result) -> None:
    """The result's bytes are the same on every rank."""
    data = np.ascontiguousarray(as_numpy(result))
    digest = zlib.crc32(data.view(np.uint8).tobytes())
    from mpi4py import MPI
    everyone = MPI.COMM_WORLD.allgather(digest)
    assert len(set(everyone)) == 1, f"results differ between ranks: {everyone}"


def compare(shm_result, mpi_result, dtype: str, exact: bool) -> None:
    a, b = as_numpy(shm_result), as_numpy(mpi_result)
    assert a.shape == b.shape and a.dtype == b.dtype
    if exact or dtype in ("bool", "bfloat16", "float16") or dtype[0] in "iu":
        np.testing.assert_array_equal(a, b)
    else:
        rtol = 1e-5 if dtype in ("float32", "complex64") else 1e-12
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * 4)


def both_paths(name: str, call, shm_expected: bool):
    """``call()`` through shared memory then through MPI; the counters say which ran."""
    before = node_shm.COUNTS[name]
    options.shm = "1"
    via_shm = call()
    assert node_shm.COUNTS[name] == before + int(shm_expected), "shared memory not used"
    options.shm = "0"
    via_mpi = call()
    assert node_shm.COUNTS[name] == before + int(shm_expected), "COMMLIB_SHM=0 used it"
    return via_shm, via_mpi


def valid_ops(dtype: str) -> list[ReduceOp]:
    from commlib.base import dtypes
    out = []
    for op in OPS:
        try:
            mpi_op(op, dtypes.get(dtype), "test", 0)
        except ValueError:
            continue
        out.append(op)
    return out


@pytest.mark.mpi
@pytest.mark.usefixtures("setting")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind,dtype", CASES)
def test_allreduce(group, kind, dtype, size):
    r, n = group.rank, group.size
    count = numel(size, dtype)
    for op in valid_ops(dtype):
        vals = values(r, count, dtype, op, 1)

        def call():
            t = make(vals, kind, dtype)
            assert commlib.allreduce(t, op=op, group=group) is t
            return t

        via_shm, via_mpi = both_paths("allreduce", call, n > 1)
        compare(via_shm, via_mpi, dtype, n <= 2 and op is not ReduceOp.AVG)
        same_everywhere(via_shm)


@pytest.mark.mpi
@pytest.mark.usefixtures("setting")
@pytest.mark.parametrize("size", ["one", "tiny", "below", "steps"])
@pytest.mark.parametrize("kind,dtype", [("numpy", "bool"), ("numpy", "int8"),
                                        ("numpy", "uint64"), ("numpy", "float32"),
                                        ("numpy", "complex128"), ("torch", "bfloat16"),
                                        ("numpy", "float16")])
def test_allreduce_split_steps(group, kind, dtype, size, monkeypatch):
    """From 3 ranks, steps above WHOLE_STEP_BYTES are reduced a slice per rank and copied
    out of rank 0's segment (here every step, the threshold set to 0)."""
    monkeypatch.setattr(node_shm, "WHOLE_STEP_BYTES", 0)
    test_allreduce(group, kind, dtype, size)


@pytest.mark.mpi
@pytest.mark.usefixtures("setting")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind,dtype", CASES)
def test_reduce_scatter(group, kind, dtype, size):
    r, n = group.rank, group.size
    count = numel(size, dtype) * n + (size != "empty")  # blocks of unequal sizes
    for op in valid_ops(dtype):
        vals = values(r, count, dtype, op, 2)
        via_shm, via_mpi = both_paths(
            "reduce_scatter",
            lambda: commlib.reduce_scatter(make(vals, kind, dtype), op=op, group=group),
            n > 1)
        assert via_shm.shape[0] == commlib.block_sizes(count, n)[r]
        compare(via_shm, via_mpi, dtype, n <= 2 and op is not ReduceOp.AVG)


@pytest.mark.mpi
@pytest.mark.usefixtures("setting")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind,dtype", CASES)
def test_allgather(group, kind, dtype, size):
    r, n = group.rank, group.size
    vals = values(r, numel(size, dtype), dtype, ReduceOp.SUM, 3)
    via_shm, via_mpi = both_paths(
        "allgather", lambda: commlib.allgather(make(vals, kind, dtype), group=group), n > 1)
    assert tuple(via_shm.shape) == (n, vals.size)
    compare(via_shm, via_mpi, dtype, True)
    compare(via_shm[r], make(vals, kind, dtype), dtype, True)
    same_everywhere(via_shm)


@pytest.mark.mpi
@pytest.mark.usefixtures("setting")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind,dtype", CASES)
def test_broadcast(group, kind, dtype, size):
    r, n = group.rank, group.size
    src = n - 1
    vals = values(r, numel(size, dtype), dtype, ReduceOp.SUM, 4)
    root_vals = values(src, numel(size, dtype), dtype, ReduceOp.SUM, 4)

    def call():
        t = make(vals, kind, dtype)
        assert commlib.broadcast(t, src=src, group=group) is t
        return t

    via_shm, via_mpi = both_paths("broadcast", call, n > 1)
    compare(via_shm, via_mpi, dtype, True)
    compare(via_shm, make(root_vals, kind, dtype), dtype, True)


@pytest.mark.mpi
@pytest.mark.usefixtures("setting")
def test_shapes_and_non_contiguous(group):
    """A 2-D result, a strided input (worked on as a contiguous copy, written back), an
    ``out`` buffer given by the caller, AVG."""
    r, n = group.rank, group.size
    options.shm = "1"
    before = dict(node_shm.COUNTS)
    base = np.arange(3000, dtype=np.float64).reshape(100, 30) + r
    view = base[:, ::3]
    commlib.allreduce(view, op=ReduceOp.AVG, group=group)
    expected = np.arange(3000, dtype=np.float64).reshape(100, 30)[:, ::3] + (n - 1) / 2
    np.testing.assert_array_equal(view, expected)
    np.testing.assert_array_equal(base[:, 1::3], np.arange(3000.).reshape(100, 30)[:, 1::3] + r)
    out = np.empty((n, 7, 5), np.int32)
    got = commlib.allgather(np.full((7, 5), r, np.int32), group=group, out=out)
    assert got is out and all((out[k] == k).all() for k in range(n))
    rs_out = np.empty(commlib.block_sizes(1001, n)[r], np.int64)
    got = commlib.reduce_scatter(np.ones(1001, np.int64), group=group, out=rs_out)
    assert got is rs_out and (rs_out == n).all()
    used = n > 1
    assert node_shm.COUNTS["allreduce"] == before["allreduce"] + used
    assert node_shm.COUNTS["allgather"] == before["allgather"] + used
    assert node_shm.COUNTS["reduce_scatter"] == before["reduce_scatter"] + used


@pytest.mark.mpi
@pytest.mark.usefixtures("setting")
def test_dispatch_by_size_async_and_world_window(monkeypatch):
    """``auto``: shared memory inside the measured ranges (on the world's own window, 1 MiB
    halves: 1.5 MiB takes two steps), MPI outside them (below the first, between two, for
    allgather and broadcast; from OVERSUBSCRIBED_MAX_BYTES on where ranks outnumber cores);
    ``async_op=True`` below ASYNC_MIN_BYTES stays on MPI
    (test_node_shm_async has the rest); ``0`` never. The dispatch is
    checked with MPICH's ranges on every runtime (each runtime's own are checked below)."""
    r, n = commlib.get_rank(), commlib.get_world_size()
    for op, ranges in node_shm.MPICH_AUTO_RANGES.items():
        monkeypatch.setitem(node_shm.AUTO_RANGES, op, ranges)
    options.shm = "auto"
    world_window = node_shm.window(commlib.world().comm) if n > 1 else None
    if world_window is not None:  # the ranks' caches shared (test_far_node_dispatch: not)
        monkeypatch.setattr(world_window, "far", False)
    (low, high), (big, _) = node_shm.AUTO_RANGES["allreduce"]
    # ranks outnumbering cores (the waits sleep): from OVERSUBSCRIBED_MAX_BYTES on, MPI
    crowded = commlib.world().comm.poll_s > 0
    cases = ((low - 4, False), (low, n > 1), ((3 << 20) // 2, n > 1), (high, False),
             (big, n > 1 and not crowded))
    for nbytes, used in cases:
        assert node_shm.auto("allreduce", nbytes) == (low <= nbytes < high or nbytes >= big)
        before = node_shm.COUNTS["allreduce"]
        x = np.full(nbytes // 4, r + 1.0, np.float32)
        commlib.allreduce(x)
        assert (x == n * (n + 1) / 2).all()
        assert node_shm.COUNTS["allreduce"] == before + used, (nbytes, used)
    before = dict(node_shm.COUNTS)
    x = np.full(low, r + 1.0, np.float32)
    commlib.allreduce(x, async_op=True).wait()
    y = commlib.allgather(np.full(low, r, np.float32), async_op=True).wait()
    assert (x == n * (n + 1) / 2).all() and all((y[k] == k).all() for k in range(n))
    commlib.allgather(np.full(low, r, np.float32))  # never under auto
    commlib.broadcast(x, src=0)
    assert node_shm.COUNTS == before
    options.shm = "0"
    commlib.reduce_scatter(np.ones(1 << 20, np.float32))
    assert node_shm.COUNTS == before
    options.shm = "auto"
    commlib.reduce_scatter(np.ones(1 << 20, np.float32))
    assert node_shm.COUNTS["reduce_scatter"] == before["reduce_scatter"] + (n > 1 and
                                                                           not crowded)
    if crowded:
        commlib.reduce_scatter(np.ones((1 << 20) - 1024, np.float32))  # below 4 MiB
        assert node_shm.COUNTS["reduce_scatter"] == before["reduce_scatter"] + 1
    if n > 1:
        nw = node_shm.window(commlib.world().comm)
        assert nw.whole and nw.half_bytes == node_shm.SEGMENT_BYTES


@pytest.mark.mpi(min_size=2)
@pytest.mark.usefixtures("setting")
def test_far_node_dispatch_and_the_probe(monkeypatch):
    """The cross-core probe (shm_window.cross_core_ratio) answers the same on every rank,
    again when rerun; on a *far* node (forced here: which one this machine is varies from
    job to job) ``auto`` keeps the tier only inside FAR_RANGES as well: allreduce 1.5 MiB
    yes, 32 MiB no; reduce_scatter 512 KiB yes, 4 MiB no; ``1`` takes it anyway."""
    from mpi4py import MPI

    from commlib.primitives import shm_window
    r, n = commlib.get_rank(), commlib.get_world_size()
    nw = node_shm.window(commlib.world().comm)
    assert nw is not None and nw.cross_ratio > 0
    again = shm_window.cross_core_ratio(nw)
    for value in (nw.cross_ratio, nw.far, again):
        assert len(set(MPI.COMM_WORLD.allgather(value))) == 1, value
    assert nw.far == (nw.cross_ratio > shm_window.FAR_RATIO)
    for op, ranges in node_shm.MPICH_AUTO_RANGES.items():
        monkeypatch.setitem(node_shm.AUTO_RANGES, op, ranges)
    monkeypatch.setattr(nw, "far", True)
    monkeypatch.setattr(commlib.world().comm, "poll_s", 0.0)  # not crowded
    options.shm = "auto"
    for op, nbytes, used in (("allreduce", (3 << 20) // 2, True),
                             ("allreduce", 32 << 20, False),
                             ("reduce_scatter", 512 << 10, True),
                             ("reduce_scatter", 4 << 20, False)):
        before = node_shm.COUNTS[op]
        x = np.full(nbytes // 4, r + 1.0, np.float32)
        if op == "allreduce":
            commlib.allreduce(x)
            assert (x == n * (n + 1) / 2).all()
        else:
            commlib.reduce_scatter(x)
        assert node_shm.COUNTS[op] == before + used, (op, nbytes, used)
    options.shm = "1"
    before = node_shm.COUNTS["allreduce"]
    commlib.allreduce(np.ones((32 << 20) // 4, np.float32))
    assert node_shm.COUNTS["allreduce"] == before + 1


def test_auto_ranges_per_runtime():
    """``COMMLIB_SHM=auto`` takes the ranges measured on this process's MPI: MPICH's
    defaults, overridden per operation by the implementation's ``shm_auto_ranges``; every
    range well formed and ascending (``auto`` stops below the first)."""
    from commlib.mpi import mpi_impl as impls
    impl = impls.current()
    expected = {**node_shm.MPICH_AUTO_RANGES, **dict(impl.shm_auto_ranges)}
    assert node_shm.AUTO_RANGES == expected
    assert set(expected) == {"allreduce", "reduce_scatter", "allgather", "broadcast"}
    for op, ranges in expected.items():
        lows = [low for low, _ in ranges]
        assert lows == sorted(lows), op
        for low, high in ranges:
            assert low > 0 and (high is None or high > low), (op, low, high)
            assert node_shm.auto(op, low) and (high is None or node_shm.auto(op, high - 1))
        assert not ranges or not node_shm.auto(op, ranges[0][0] - 1), op
    for key in ("mpich", "openmpi", "intel"):   # every known runtime names known ops only
        other = impls.identify({"mpich": "MPICH Version: 5.0.2",
                                   "openmpi": "Open MPI v5.0.11",
                                   "intel": "Intel(R) MPI Library 2021.18.1"}[key])
        assert other.key == key
        assert set(dict(other.shm_auto_ranges)) <= set(node_shm.MPICH_AUTO_RANGES), key


@pytest.mark.mpi
@pytest.mark.usefixtures("setting")
@pytest.mark.parametrize("kind,dtype", [("numpy", "int64"), ("numpy", "float32"),
                                        ("torch", "bfloat16"), ("numpy", "float64")])
def test_hierarchical_node_tier(kind, dtype):
    """The hierarchical allreduce over emulated nodes of 2 ranks (COMMLIB_LOCAL_SIZE=2):
    shared memory inside each node, MPI between the leaders, the same result as the MPI
    path; at 3 ranks the node of one rank makes every rank take the MPI path."""
    r, n = commlib.get_rank(), commlib.get_world_size()
    saved_local, saved_half = options.local_size, node_shm.SEGMENT_BYTES
    options.local_size = 2
    node_shm.SEGMENT_BYTES = HALF
    try:
        g = commlib.new_group(hierarchical=True)
        g.comm.node()
    finally:
        options.local_size = saved_local
        node_shm.SEGMENT_BYTES = saved_half
    used = n in (2, 4)
    try:
        for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG):
            if op is ReduceOp.AVG and dtype == "int64":
                continue
            for count in (1, 1000, 3 * HALF // itemsize(dtype) + 5):
                vals = values(r, count, dtype, op, 5)
                before = node_shm.COUNTS["hierarchical"]

                def call():
                    t = make(vals, kind, dtype)
                    commlib.allreduce(t, op=op, group=g)
                    return t

                via_shm, via_mpi = both_paths("hierarchical", call, used)
                compare(via_shm, via_mpi, dtype, False)
                same_everywhere(via_shm)
                assert node_shm.COUNTS["hierarchical"] == before + used
    finally:
        g.free()


@pytest.mark.mpi
def test_nothing_named_in_dev_shm():
    """The windows' files (MPICH: mpich_shar_tmp*) are unlinked once every rank mapped
    them: none of the files this rank maps still has a name (the MPI library's own
    segments excepted, which commlib.mpi.shm releases)."""
    from commlib.mpi.mpi_impl import current
    from helpers import shm_segments
    mpi_own = tuple(current().shm_prefixes)
    named = [s for s in shm_segments() if os.path.exists(os.path.join("/dev/shm", s))
             and not s.startswith(mpi_own) and not s.startswith("torch_")]
    assert not named, named


# -- a rank killed inside a shared-memory collective (serial session: its own jobs) --------

PROGRAM = os.path.join(os.path.dirname(__file__), "node_shm_ft_program.py")
FT_RANKS = 3


@serial_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "allgather", "broadcast"])
def test_rank_killed_mid_collective(tmp_path, op):
    from elastic_common import fault_tolerance_refusal, leftover_shm, results, run_job
    why = fault_tolerance_refusal()
    if why:
        pytest.skip(why)
    if mpi_impl().rank_domain_hosts(FT_RANKS) is not None and op != "allreduce":
        pytest.skip("this launcher's fault-tolerant jobs make each rank a node of its own: "
                    "no shared-memory tier, the allreduce case covers the MPI path")
    status, seconds, out, left = run_job(FT_RANKS, [PROGRAM, str(tmp_path), op], 120)
    assert status != -9, f"hang (killed after 120 s)\n{out[-3000:]}"
    assert not left, f"processes {left} of the job were left running"
    assert not leftover_shm(str(tmp_path)), leftover_shm(str(tmp_path))
    found = results(str(tmp_path))
    assert sorted(found) == list(range(FT_RANKS - 1)), out[-3000:]
    # Open MPI and Intel MPI launch every rank on one node; MPICH's fault-tolerant launch
    # (a hydra proxy per rank, each its own host) makes each rank a node of its own: there
    # the collectives take the MPI path
    one_node = mpi_impl().rank_domain_hosts(FT_RANKS) is None
    for rank, data in found.items():
        assert data["iters"] == 12 and data["failures"] == 1 and data["size"] == FT_RANKS - 1
        # every iteration went through shared memory, before and after the shrink
        # (5 before the kill, 7 after: the killed call completed nowhere)
        assert data["shm_calls"][op] == (12 if one_node else 0), data
        assert data["failed_after_s"] < 30, data


@serial_only
@pytest.mark.timeout(300)
def test_rank_killed_without_fault_tolerance_ends_the_job(tmp_path):
    """Control: the same kill with fault tolerance off: no survivor finishes, the job ends
    (the watchdog's abort) instead of hanging."""
    from elastic_common import fault_tolerance_refusal, results, run_job
    why = fault_tolerance_refusal()
    if why:
        pytest.skip(why)
    status, seconds, out, left = run_job(FT_RANKS, [PROGRAM, str(tmp_path), "allreduce",
                                                    "--no-ft"], 120, COMMLIB_TIMEOUT="10")
    assert status not in (0, -9), f"status {status}\n{out[-3000:]}"
    assert not left
    assert results(str(tmp_path)) == {}
