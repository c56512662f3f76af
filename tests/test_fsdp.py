"""commlib.FullyShardedDataParallel (NO_SHARD, SHARD_GRAD_OP = ZeRO-2, FULL_SHARD = ZeRO-3)
against single-process training on the whole batch: float64, 1e-10 after every step, the
full parameters of every replica checked (and bitwise equal across ranks). The model has a
tied weight and a frozen bias, and chunks small enough to cut it unevenly. A variant whose
chunks are never re-gathered, and one whose gradients are never reduced, must be rejected
by the same check. A full state saved at N ranks resumes on N-1 ranks."""
import io
import re

import pytest

torch = pytest.importorskip("torch")

import commlib  # noqa: E402
from sharded_common import (  # noqa: E402
    OPTIMIZERS,
    check_replicas,
    loss_fn,
    make_model,
    reference_optimizer,
    replica_errors,
    two_groups,
)

GLOBAL_BATCH = 12          # divisible by 1, 2, 3 and 4 ranks
CHUNK_MB = 0.0005          # ~65 float64 elements: several chunks, uneven shards


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 10, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)


def mine(t, group=None):
    rank = commlib.get_rank() if group is None else group.rank
    size = commlib.get_world_size() if group is None else group.size
    per = GLOBAL_BATCH // size
    return t[rank * per:(rank + 1) * per]


def flat_state(sd):
    return torch.cat([v.detach().double().reshape(-1) for v in sd.values()])


def wrap(model, strategy, opt_name, group=None):
    cls, kw, split = OPTIMIZERS[opt_name]
    groups = two_groups(list(model.named_parameters())) if split else None
    fsdp = commlib.FullyShardedDataParallel(model, strategy, group, chunk_size_mb=CHUNK_MB,
                                            param_groups=groups)
    opt = cls(fsdp.sharded_param_groups(), **kw)
    return fsdp, opt


def step_both(fsdp, opt, ref, ref_opt, step, group=None, accumulate=1, clip=None):
    x, y = batch(step)
    opt.zero_grad()
    xs, ys = mine(x, group), mine(y, group)
    for k, (xk, yk) in enumerate(zip(xs.tensor_split(accumulate), ys.tensor_split(accumulate))):
        weight = len(xk) / len(xs)   # the micro-batch means weighted into the batch mean
        if k < accumulate - 1:
            with fsdp.no_sync():
                (loss_fn(fsdp, xk, yk) * weight).backward()
        else:
            (loss_fn(fsdp, xk, yk) * weight).backward()
    if clip is not None:
        norm = fsdp.clip_grad_norm_(clip)
    opt.step()
    ref_opt.zero_grad()
    loss_fn(ref, x, y).backward()
    if clip is not None:
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        assert abs(float(norm) - float(ref_norm)) < 1e-10
    ref_opt.step()
    return replica_errors(flat_state(fsdp.state_dict()), flat_state(ref.state_dict()), group)


def train(strategy, opt_name, steps=8, broken=None, **kw):
    ref = make_model()
    ref_opt = reference_optimizer(ref, opt_name)
    fsdp, opt = wrap(make_model(), strategy, opt_name)
    if broken == "never_gathered":
        fsdp._gather = lambda c: c.mark_gathered()
    elif broken == "not_reduced":
        fsdp._exchange = lambda c, grad: grad.view(c.shards, -1)[fsdp.rank].clone()
    try:
        return [step_both(fsdp, opt, ref, ref_opt, s, **kw) for s in range(steps)], fsdp, opt
    finally:
        fsdp.close()


# every optimizer under FULL_SHARD; the other strategies with a subset (CI time)
CASES = [("FULL_SHARD", o) for o in sorted(OPTIMIZERS)] + [
    ("SHARD_GRAD_OP", "adam"), ("SHARD_GRAD_OP", "sgd_momentum"),
    ("NO_SHARD", "adamw_two_groups")]


@pytest.mark.mpi
@pytest.mark.parametrize("strategy,opt_name", CASES)
def test_parity(strategy, opt_name, one_thread_per_rank):
    history, fsdp, opt = train(strategy, opt_name, steps=6)
    check_replicas(history)
    n = commlib.get_world_size()
    shards = sum(p.numel() for p in fsdp.parameters())
    total = sum(c.numel for c in fsdp._chunks)
    if strategy == "NO_SHARD":
        assert shards == total
    else:   # 1/N of the elements (plus padding), and so 1/N of the optimizer state
        assert shards == sum(c.padded for c in fsdp._chunks) // n
        assert shards < total + len(fsdp._chunks) * n and (n == 1 or shards < total)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "FULL_SHARD"])
def test_no_sync_accumulation_and_clipping(strategy, one_thread_per_rank):
    """Two micro-batches per step, the first under no_sync(), and global-norm clipping."""
    if GLOBAL_BATCH // commlib.get_world_size() < 2:
        pytest.skip("needs two samples per rank")
    history, *_ = train(strategy, "adam", steps=6, accumulate=2, clip=0.5)
    check_replicas(history)


@pytest.mark.mpi
@pytest.mark.parametrize("broken", ["never_gathered", "not_reduced"])
def test_negative_controls_are_rejected(broken, one_thread_per_rank):
    if commlib.get_world_size() == 1:
        pytest.skip("one rank holds the whole chunk: nothing to gather or reduce")
    strategy = "SHARD_GRAD_OP" if broken == "never_gathered" else "FULL_SHARD"
    history, *_ = train(strategy, "sgd_momentum", steps=3, broken=broken)
    with pytest.raises(AssertionError):
        check_replicas(history)


@pytest.mark.mpi
def test_reshard_resume_on_fewer_ranks(one_thread_per_rank):
    """Train 4 steps at N ranks, save the full model and optimizer state, resume on N-1
    ranks (a subgroup; N at one rank) from a differently initialized model: the resumed run
    matches an uninterrupted single-process run."""
    n = commlib.get_world_size()
    ref = make_model()
    ref_opt = reference_optimizer(ref, "adamw_two_groups")
    fsdp, opt = wrap(make_model(), "FULL_SHARD", "adamw_two_groups")
    check_replicas([step_both(fsdp, opt, ref, ref_opt, s) for s in range(4)])
    buf = io.BytesIO()
    torch.save({"model": fsdp.state_dict(),
                "optim": commlib.FullyShardedDataParallel.optim_state_dict(fsdp, opt)}, buf)
    fsdp.close()
    sub = commlib.new_group(range(max(1, n - 1)))
    history = []
    if sub.is_member:
        saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        fsdp2, opt2 = wrap(make_model(seed=42), "SHARD_GRAD_OP" if n % 2 else "FULL_SHARD",
                           "adamw_two_groups", group=sub)
        fsdp2.load_state_dict(saved["model"])
        opt2.load_state_dict(commlib.FullyShardedDataParallel.optim_state_dict_to_load(
            fsdp2, opt2, saved["optim"]))
        history = [step_both(fsdp2, opt2, ref, ref_opt, s, group=sub) for s in range(4, 8)]
        fsdp2.close()
        sub.free()
    check_replicas(history)


@pytest.mark.mpi
def test_state_dict_round_trip_and_eval_without_grad(one_thread_per_rank):
    """state_dict() has module.state_dict()'s keys; loading it into a fresh wrapper gives
    the same outputs; a no_grad forward leaves nothing gathered (FULL_SHARD)."""
    model = make_model()
    expected_keys = list(make_model().state_dict())
    fsdp = commlib.FullyShardedDataParallel(model, "FULL_SHARD", chunk_size_mb=CHUNK_MB)
    sd = fsdp.state_dict()
    assert list(sd) == expected_keys
    other = commlib.FullyShardedDataParallel(make_model(seed=5), "FULL_SHARD",
                                             chunk_size_mb=CHUNK_MB)
    other.load_state_dict(sd)
    x, _ = batch(0)
    with torch.no_grad():
        a, b = fsdp(x), other(x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(not c.gathered for c in other._chunks if c.shards > 1)
    with pytest.raises(RuntimeError, match="Missing key"):
        other.load_state_dict({k: v for k, v in sd.items() if k != "head.bias"})
    fsdp.close()
    other.close()


def test_bad_arguments():
    with pytest.raises(ValueError, match="sharding_strategy"):
        commlib.FullyShardedDataParallel(make_model(), "HYBRID")
    with pytest.raises(ValueError, match="chunk_size_mb"):
        commlib.FullyShardedDataParallel(make_model(), chunk_size_mb=0)
    with pytest.raises(TypeError, match="module"):
        commlib.FullyShardedDataParallel("model")
    with pytest.raises(ValueError, match="not a parameter"):
        commlib.FullyShardedDataParallel(make_model(), param_groups=[{"params": ["nope"]}])
    assert commlib.ShardingStrategy.FULL_SHARD == "FULL_SHARD"


@pytest.mark.mpi
def test_train_digits_full_shard(capsys, one_thread_per_rank):
    """The example's --sharding FULL_SHARD path, in process on every rank, one epoch (at 2
    ranks only: CI time)."""
    if commlib.get_world_size() != 2:
        pytest.skip("runs at 2 ranks")
    pytest.importorskip("sklearn")
    from commlib.examples import train_digits
    threads = torch.get_num_threads()
    try:
        assert train_digits.main(["--sharding", "FULL_SHARD", "--epochs", "1",
                                  "--no-progress"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    if commlib.get_rank() == 0:
        assert "sharding FULL_SHARD" in out
        assert float(re.search(r"test accuracy ([0-9.]+)", out).group(1)) > 0.5, out


@pytest.mark.mpi
@pytest.mark.parametrize("broken", [False, True])
def test_mixed_precision_float32_compute_float64_master(broken, one_thread_per_rank):
    """param_dtype=float32 on a float64 model: chunks gathered (half the bytes) and
    gradients reduced in float32, shards, optimizer state and state_dict in float64; within
    float32 rounding of the float64 single-process run. Not reducing must be rejected."""
    from commlib.sharded import MixedPrecision
    if broken and commlib.get_world_size() == 1:
        pytest.skip("one rank: nothing to reduce")
    ref = make_model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    fsdp = commlib.FullyShardedDataParallel(make_model(), "FULL_SHARD", chunk_size_mb=CHUNK_MB,
                                            mixed_precision=MixedPrecision(torch.float32))
    if broken:
        fsdp._exchange = lambda c, grad: grad.view(c.shards, -1)[fsdp.rank].clone()
    opt = torch.optim.Adam(fsdp.parameters(), lr=0.01)
    errors = [step_both(fsdp, opt, ref, ref_opt, s)[0] for s in range(4)]
    before = commlib.stats().get("allgather", {}).get("bytes", 0)
    with torch.no_grad():
        fsdp(batch(0)[0])
    gathered = commlib.stats().get("allgather", {}).get("bytes", 0) - before
    fsdp.close()
    assert all(c.full.dtype == torch.float32 and c.shard.dtype == torch.float64
               for c in fsdp._chunks)
    assert all(v.dtype == torch.float64 for s in opt.state.values() for v in s.values()
               if v.dim())
    if fsdp.world_size > 1:   # a forward gathers each chunk once, as float32 shards
        assert gathered == sum(c.shard_numel * 4 for c in fsdp._chunks)
    if broken:
        assert max(errors) > 1e-4
    else:
        assert max(errors) < 1e-5, errors


def test_mixed_precision_bfloat16_trains():
    from commlib.sharded import MixedPrecision
    fsdp = commlib.FullyShardedDataParallel(
        make_model().float(), "FULL_SHARD", chunk_size_mb=CHUNK_MB,
        mixed_precision=MixedPrecision(torch.bfloat16, torch.float32))
    opt = torch.optim.Adam(fsdp.parameters(), lr=0.01)
    losses = []
    x, y = batch(0)
    for _ in range(15):
        opt.zero_grad()
        loss = loss_fn(fsdp, x, y)
        assert loss.dtype == torch.bfloat16
        loss.backward()
        opt.step()
        losses.append(loss.item())
    fsdp.close()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in fsdp.parameters() if p.requires_grad)
    assert losses[-1] < 0.8 * losses[0], losses
    with pytest.raises(TypeError, match="param_dtype"):
        commlib.FullyShardedDataParallel(make_model(), mixed_precision={"param_dtype": "bf16"})


def test_mixed_precision_casts_keyword_inputs():
    """Keyword inputs of the forward are cast to param_dtype like positional ones (a
    keyword tensor raised NameError in the cast before)."""
    from commlib.sharded import MixedPrecision

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x, *, scale):
            assert scale.dtype == torch.float32, scale.dtype
            return self.fc(x) * scale

    fsdp = commlib.FullyShardedDataParallel(Scaled().double(),
                                            mixed_precision=MixedPrecision(torch.float32))
    out = fsdp(torch.ones(3, 4, dtype=torch.float64), scale=torch.tensor(2.0, dtype=torch.float64))
    assert out.dtype == torch.float32
    fsdp.close()


def test_threads_poll_when_ranks_outnumber_cores(monkeypatch):
    """The sharded wrappers' communication threads wait as the communicator chose (option
    wait_poll_us: test-and-sleep 50 us instead of spinning in MPI when some host runs more
    ranks than cores; bench_zero.py --wait both: at 4 ranks on 2 cores FULL_SHARD's step
    halved), unless ``groups.WAIT_POLL_S`` forces a value for them."""
    from commlib.sharded import groups
    for forced, expected in ((None, None), (50e-6, 50e-6), (0.0, 0.0)):
        monkeypatch.setattr(groups, "WAIT_POLL_S", forced)
        assert groups.wait_poll_s() == expected, forced
        model = make_model()
        fsdp = commlib.FullyShardedDataParallel(model, "FULL_SHARD", chunk_size_mb=CHUNK_MB)
        zero = commlib.ZeroRedundancyOptimizer(make_model().parameters(), torch.optim.SGD,
                                               lr=0.1)
        try:
            assert fsdp._engine.poll_s == fsdp._gather_engine.poll_s == expected
            assert zero._engine.poll_s == expected
        finally:
            fsdp.close()
            zero.close()
