"""Non-finite values on one rank (the AMP overflow case): what every algorithm does.

* Gradient-exchanging algorithms: non-finite input on any rank gives non-finite
  gradients on every rank, so a GradScaler-style check skips the step on every rank, and
  the compression state is untouched: the run equals, bit for bit, a run in which the bad
  step never happened (with a negative control: a step skipped after its state was kept
  does show up).
* Weight-exchanging algorithms: non-finite weights are never averaged into the replicas;
  every rank that would receive them raises NonFiniteError naming the rank.

Multi-rank (``mpi``): run by tests/run_all.sh at 2, 3 and 4 ranks.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import commlib  # noqa: E402
from commlib import NonFiniteError  # noqa: E402
from commlib.primitives import CompressionState, compressed_allreduce  # noqa: E402
from models import MLP  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("one_thread_per_rank")]

CHUNK = 16
BUCKET_MB = 0.002  # several buckets for the 1.6k-parameter MLP
NAN = float("nan")


def world():
    return commlib.get_rank(), commlib.get_world_size()


def gathered_bits(x) -> np.ndarray:
    """Every rank's float32 values as raw bits (NaN compares equal to the same NaN)."""
    mine = np.ascontiguousarray(np.asarray(x, dtype=np.float32)).view(np.uint32)
    return np.asarray(commlib.allgather(mine))


def identical_everywhere(x) -> bool:
    rows = gathered_bits(x)
    return bool((rows == rows[0]).all())


# -- the compressed allreduce ------------------------------------------------------------

def _inputs(length=1000, seed=0):
    rank, n = world()
    return np.random.default_rng(seed + rank).standard_normal(length).astype(np.float32)


@pytest.mark.parametrize("method", ["minmax_uint8", "sign1"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_on_one_rank_is_nan_in_that_chunk_everywhere(method, bad):
    rank, n = world()
    if n == 1:
        pytest.skip("needs peers")
    length, at = 1000, 613
    x = _inputs(length)
    clean = x.copy()
    if rank == n - 1:
        x[at] = bad
        clean[at] = 0.0
    state, clean_state = CompressionState(), CompressionState()
    compressed_allreduce(x, group=None, method=method, chunk_size=CHUNK, state=state)
    compressed_allreduce(clean, group=None, method=method, chunk_size=CHUNK,
                         state=clean_state)
    part = -(-length // n)
    j, c = at // part, (at % part) // CHUNK
    first, last = j * part + c * CHUNK, min(j * part + (c + 1) * CHUNK, (j + 1) * part, length)
    assert np.isnan(x[first:last]).all()
    outside = np.ones(length, bool)
    outside[first:last] = False
    if method == "minmax_uint8":  # other chunks: exactly the clean result
        assert np.array_equal(x[outside], clean[outside])
    assert np.isfinite(x[outside]).all()
    assert identical_everywhere(x)
    assert not state.finite and clean_state.finite
    assert state.worker is None or not state.worker.any()  # nothing kept


def test_sign1_state_as_if_the_bad_call_never_happened():
    rank, n = world()
    if n == 1:
        pytest.skip("needs peers")
    calls = [_inputs(seed=s) for s in range(4)]
    bad = calls[2].copy()
    if rank == n - 1:
        bad[17] = np.nan
    with_bad, without = CompressionState(), CompressionState()
    for x in calls[:2] + [bad] + calls[3:]:
        out = x.copy()
        compressed_allreduce(out, method="sign1", chunk_size=CHUNK, state=with_bad)
    for x in calls[:2] + calls[3:]:
        ref = x.copy()
        compressed_allreduce(ref, method="sign1", chunk_size=CHUNK, state=without)
    assert np.array_equal(out, ref)
    assert np.array_equal(with_bad.worker, without.worker)
    assert np.array_equal(with_bad.server, without.server)
    # negative control: keeping a clean call that the reference never made does show
    kept = CompressionState()
    for x in calls:
        out = x.copy()
        compressed_allreduce(out, method="sign1", chunk_size=CHUNK, state=kept)
    assert not np.array_equal(kept.worker, without.worker)


def test_deferred_commit_keeps_all_or_nothing():
    rank, n = world()
    if n == 1:
        pytest.skip("needs peers")
    a, b = CompressionState(), CompressionState()
    for state in (a, b):
        compressed_allreduce(_inputs(), method="sign1", chunk_size=CHUNK, state=state)
    before = [s.worker.copy() for s in (a, b)]
    x, y = _inputs(seed=5), _inputs(seed=6)
    if rank == 0:
        y[3] = np.inf
    compressed_allreduce(x, method="sign1", chunk_size=CHUNK, state=a, commit=False)
    compressed_allreduce(y, method="sign1", chunk_size=CHUNK, state=b, commit=False)
    assert a.finite and not b.finite
    for s in (a, b):
        s.discard()
    assert all(np.array_equal(s.worker, w) for s, w in zip((a, b), before))
    compressed_allreduce(x, method="sign1", chunk_size=CHUNK, state=a, commit=False)
    a.commit()
    assert not np.array_equal(a.worker, before[0])


def test_hierarchical_compressed_allreduce_propagates():
    rank, n = world()
    if n < 4:
        pytest.skip("needs two simulated nodes of two ranks")
    previous = commlib.options.local_size
    commlib.options.local_size = 2
    try:
        group = commlib.new_group()
        x = _inputs()
        if rank == 1:  # not a node leader
            x[500] = np.nan
        state = CompressionState()
        compressed_allreduce(x, group=group, method="sign1", chunk_size=CHUNK, state=state,
                             hierarchical=True)
        assert not np.isfinite(x).all() and not state.finite
        assert identical_everywhere(x)
        group.free()
    finally:
        commlib.options.local_size = previous


# -- DDP: gradient-exchanging algorithms skip the step on every rank ---------------------

def _qadam_opt(params):
    from commlib.algorithms.qadam import QAdamOptimizer
    return QAdamOptimizer(params, lr=0.01)


GRADIENT_ALGORITHMS = {
    "gradient_allreduce": ({}, None),
    "bytegrad": ({"chunk_size": CHUNK}, None),
    "qadam-sign1": ({"warmup_steps": 2, "chunk_size": CHUNK}, _qadam_opt),
    "qadam-minmax": ({"warmup_steps": 2, "chunk_size": CHUNK,
                      "compression": "minmax_uint8"}, _qadam_opt),
    # Inverses every iteration: the bad iteration counts as one (schedules count
    # iterations on every rank alike), so with longer intervals the reference run, which
    # lacks it, would invert at other iterations; the factors are what is compared here.
    "d_kfac": ({"lr": 0.05}, None),
    "dp_kfac": ({"lr": 0.05}, None),
}


def _batch(step):
    rank, n = world()
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)


def train(name, steps=10, nan_at=None, leave_out=None, skip_anyway=None):
    """Train with GradScaler-style skipping (no optimizer step when a local gradient is
    not finite). ``nan_at``: the last rank's loss is NaN at that step. ``leave_out``: that
    step never happens on any rank (the reference). ``skip_anyway``: every rank skips the
    optimizer step there although its gradients are finite (a negative control)."""
    rank, n = world()
    kwargs, make_opt = GRADIENT_ALGORITHMS[name]
    torch.manual_seed(0)
    model = MLP(d_in=10, hidden=32, d_out=4)
    ddp = commlib.DistributedDataParallel(model, algorithm=name.split("-")[0],
                                          bucket_cap_mb=BUCKET_MB, **kwargs)
    opt = (make_opt or (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)))(
        ddp.parameters())
    skipped = []
    try:
        for step in range(steps):
            if step == leave_out:
                continue
            x, y = _batch(step)
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            if step == nan_at and rank == n - 1:
                loss = loss * NAN
            loss.backward()
            finite = all(bool(torch.isfinite(p.grad).all()) for p in ddp.parameters())
            if finite and step != skip_anyway:
                opt.step()
            else:
                skipped.append(step)
        return torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()]), skipped
    finally:
        ddp.close()


@pytest.mark.parametrize("name", sorted(GRADIENT_ALGORITHMS))
def test_nan_on_one_rank_is_skipped_everywhere_and_leaves_no_trace(name):
    rank, n = world()
    if n == 1:
        pytest.skip("needs peers")
    bad_step = 5  # after qadam's warm-up: the compressed phase
    with_nan, skipped = train(name, nan_at=bad_step)
    reference, _ = train(name, leave_out=bad_step)
    assert skipped == [bad_step], skipped  # on every rank
    assert torch.isfinite(with_nan).all()
    assert identical_everywhere(with_nan.numpy())
    assert torch.equal(with_nan, reference)


@pytest.mark.parametrize("name", ["qadam-sign1", "qadam-minmax"])
def test_negative_control_a_kept_step_shows(name):
    """The comparison above would catch state kept from a skipped step: here every rank
    skips a finite step, whose momentum (and residuals) were kept."""
    if world()[1] == 1:
        pytest.skip("needs peers")
    kept, skipped = train(name, skip_anyway=5)
    reference, _ = train(name, leave_out=5)
    assert skipped == [5]
    assert not torch.equal(kept, reference)


def test_grad_scaler_skips_on_every_rank_under_bytegrad():
    rank, n = world()
    if n == 1:
        pytest.skip("needs peers")
    torch.manual_seed(0)
    ddp = commlib.DistributedDataParallel(MLP(d_in=10, hidden=32, d_out=4),
                                          algorithm="bytegrad", bucket_cap_mb=BUCKET_MB,
                                          chunk_size=CHUNK)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    changed = []
    try:
        for step in range(6):
            x, y = _batch(step)
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            if step == 3 and rank == n - 1:
                loss = loss * NAN
            before = [p.detach().clone() for p in ddp.parameters()]
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            changed.append(any(not torch.equal(a, p) for a, p in zip(before, ddp.parameters())))
        params = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    finally:
        ddp.close()
    assert changed == [True, True, True, False, True, True]
    assert scaler.get_scale() == 512.0  # backed off once, on every rank
    assert identical_everywhere(params.numpy())


# -- weight-exchanging algorithms never spread non-finite weights ------------------------

def _poison_last_rank(ddp):
    rank, n = world()
    if rank == n - 1:
        with torch.no_grad():
            next(ddp.module.parameters()).view(-1)[0] = NAN


def _snapshot(ddp):
    return [p.detach().clone() for p in ddp.module.parameters()]


def _weights_unchanged_except_poison(before, ddp):
    rank, n = world()
    after = _snapshot(ddp)
    return all(torch.equal(a, b) for a, b in zip(before, after)) or rank == n - 1


@pytest.mark.parametrize("name,kwargs", [("local_sgd", {"sync_every": 1}),
                                         ("decentralized", {"peer_selection_mode": "all"}),
                                         ("low_precision_decentralized", {"chunk_size": CHUNK})])
def test_non_finite_weights_raise_on_every_rank(name, kwargs):
    rank, n = world()
    if n == 1:
        pytest.skip("needs peers")
    if name == "low_precision_decentralized" and n > 3:
        pytest.skip("only the ring neighbours of the bad rank raise; with 4 ranks the "
                    "others would wait for them")
    torch.manual_seed(0)
    ddp = commlib.DistributedDataParallel(MLP(d_in=10, hidden=32, d_out=4), algorithm=name,
                                          bucket_cap_mb=BUCKET_MB, **kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)  # steps change nothing by themselves
    try:
        x, y = _batch(0)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        _poison_last_rank(ddp)
        before = _snapshot(ddp)
        with pytest.raises(NonFiniteError, match=rf"rank\(s\) \[{n - 1}\]"):
            for _ in range(2):  # decentralized exchanges at the next forward
                opt.zero_grad()
                F.cross_entropy(ddp(x), y).backward()
                opt.step()
        assert _weights_unchanged_except_poison(before, ddp)
        assert all(torch.isfinite(p).all() for p in ddp.module.parameters()) or rank == n - 1
    finally:
        ddp.close()


def test_async_non_finite_weights_stop_averaging_everywhere():
    rank, n = world()
    if n == 1:
        pytest.skip("needs peers")
    torch.manual_seed(0)
    ddp = commlib.DistributedDataParallel(MLP(d_in=10, hidden=32, d_out=4),
                                          algorithm="async_model_average", sync_interval_ms=1)
    x, y = _batch(0)
    try:
        while ddp.algorithm.rounds < 2:
            time.sleep(0.01)
        with ddp.algorithm._averager.lock:
            _poison_last_rank(ddp)
        deadline = time.monotonic() + 60
        with pytest.raises(NonFiniteError, match=rf"group ranks \[{n - 1}\]"):
            while time.monotonic() < deadline:
                ddp(x)  # raises once the background average was found not finite
                time.sleep(0.01)
        assert not ddp.algorithm._averager.running
        # corrections of earlier rounds may have been applied; none carried a NaN
        assert all(torch.isfinite(p).all() for p in ddp.module.parameters()) or rank == n - 1
    finally:
        ddp.close()
