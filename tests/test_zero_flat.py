"""ZeRO stage 1 at allreduce's bytes: commlib.ZeroRedundancyOptimizer(reduce_gradients=True)
partitions the flattened trainable elements evenly (split inside parameters), reduce-
scatters the gradients bucket by bucket in backward and all-gathers each rank's updated
elements (its local flat) in one message, or in segments under a cap.

One job, float64, a model of 353 trainable elements (odd, not a multiple of 3 or 4) and
64-element buckets (parameters cut at bucket boundaries), for SGD-momentum and Adam:

* after every step each replica's parameters equal torch's DDP over gloo + the same torch
  optimizer (1e-10), replicas bitwise identical (torch's ZeroRedundancyOptimizer steps
  exactly as that optimizer; importing ``torch.distributed.optim`` costs 5 s of
  TorchScript compilation a process);
* bytes per step (commlib's counters, backward + step) equal the formula, sum over the
  buckets of ``(n-1) L 8 // n`` (reduce-scatter) + ``(n-1) ceil(T/n) 8`` (all-gather), and
  commlib DDP's (``gradient_allreduce``) bytes for the same model within the last bucket's
  all-gather padding: ``0 <= ours - allreduce < (n-1) 8`` (less than one element a rank);
  also with the all-gather cut into segments of 37 elements a rank (``GATHER_CAP_BYTES``);
* each rank's optimizer state is ``floor`` or ``ceil(353 / n)`` elements a state tensor,
  summing to 353 over the ranks;
* negative control: one bucket never reduced (each rank keeps its own local gradient for
  its part) must fail the same parity check;
* clip_grad_norm_ (global norm over the averaged shards) equals torch's clip_grad_norm_
  on the DDP replica (norm and parameters, 1e-10, every step clipping);
* resume: the state consolidated mid-training and loaded into a fresh optimizer (same
  world size) continues bitwise as the uninterrupted run, and equals the torch
  optimizer's state.
"""
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import commlib  # noqa: E402
from sharded_common import OPTIMIZERS, TOL, Tied, data, flat, loss_fn, replica_errors  # noqa: E402
from torch_gloo import gloo_world  # noqa: E402

BUCKET_MB = 64 * 8 / 2 ** 20     # 64 float64 elements a bucket
STEPS = 3


def make(seed=3):
    torch.manual_seed(seed)
    return Tied(d_out=5).double()   # trainable: 120 + 144 + 12 + 12 + 60 + 5 = 353


def trainable(model):
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def ours(model, name):
    cls, kw, _ = OPTIMIZERS[name]
    return commlib.ZeroRedundancyOptimizer(model.parameters(), cls, reduce_gradients=True,
                                           bucket_cap_mb=BUCKET_MB, **kw)


def bus(snapshot):
    return sum(v["bus_bytes"] for v in snapshot.values())


def predicted_bytes(opt):
    n = opt.world_size
    return sum(sum((n - 1) * b.length * 8 // n for b in kind.buckets)
               + (n - 1) * max(kind.local_numel) * 8 for kind in opt._kinds) if n > 1 else 0


def local_batch(step):
    rank, n = commlib.get_rank(), commlib.get_world_size()
    x, y = data(step, n)
    return x[rank * 3:rank * 3 + 3], y[rank * 3:rank * 3 + 3]


def run(name, steps=STEPS, broken=False):
    """(per-step (error, identical) against torch DDP over gloo + the optimizer, our bytes per step,
    commlib DDP's bytes per step, our optimizer, our model)."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    cls, kw, _ = OPTIMIZERS[name]
    world = gloo_world()
    model = make()
    opt = ours(model, name)
    if broken:
        keep = opt._launch

        def launch(k, b):   # bucket 0 never reduced: this rank's local gradient kept
            if b != 0:
                return keep(k, b)
            bucket = opt._kinds[k].buckets[b]
            buf = torch.zeros(bucket.length, dtype=torch.float64)
            commlib.sharded.flat_partition.copy_in(bucket.pieces, buf, grads=True)
            at, size = bucket.local_at[opt.rank], bucket.sizes[opt.rank]
            off = bucket.offsets[opt.rank]
            opt._grads[k][at:at + size].copy_(buf[off:off + size])
            opt._launched += 1
        opt._launch = launch
    ref = TorchDDP(make(), process_group=world)
    ref_opt = cls(ref.parameters(), **kw)
    ddp_model = make()
    ddp = commlib.DistributedDataParallel(ddp_model)
    ddp_opt = cls(ddp_model.parameters(), **kw)
    history, ours_bytes, ddp_bytes = [], [], []
    try:
        for step in range(steps):
            x, y = local_batch(step)
            commlib.stats(reset=True)
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            opt.step()
            ours_bytes.append(bus(commlib.stats(reset=True)))
            ddp_opt.zero_grad()
            loss_fn(ddp, x, y).backward()
            ddp_opt.step()
            ddp_bytes.append(bus(commlib.stats(reset=True)))
            ref_opt.zero_grad()
            loss_fn(ref, x, y).backward()
            ref_opt.step()
            history.append(replica_errors(flat(model.parameters()),
                                          flat(ref.module.parameters())))
    finally:
        ddp.close()
    return history, ours_bytes, ddp_bytes, opt, model, ref_opt


def verdict(history):
    """The first step whose replicas differ or are off torch's, else None."""
    for step, (err, same) in enumerate(history):
        if not same or err > TOL:
            return f"step {step}: identical={same}, max |ours - torch| = {err:.3g}"
    return None


@pytest.mark.mpi
def test_flat_zero1_matches_torch_zero_at_allreduce_bytes(one_thread_per_rank, monkeypatch):
    from commlib.sharded import zero
    n = commlib.get_world_size()
    T = 353
    failures = []
    for name, segment in (("sgd_momentum", None), ("adam", None), ("adam", 37)):
        if segment:
            monkeypatch.setattr(zero, "GATHER_CAP_BYTES", segment * 8 * n)
        history, got, allreduce, opt, model, _ = run(name)
        if segment and n > 1:
            assert [w for _, w, _ in opt._segments[0]] == [37] * (-(-T // n) // 37) + (
                [-(-T // n) % 37] if -(-T // n) % 37 else []), opt._segments[0]
        name = f"{name}, segments of {segment}" if segment else name
        bad = verdict(history)
        if bad:
            failures.append(f"{name}: {bad}")
        assert trainable(model) == T
        # bytes: the formula exactly, allreduce's within the padding
        assert all(b == predicted_bytes(opt) for b in got), (name, got, predicted_bytes(opt))
        for b, a in zip(got, allreduce):
            assert 0 <= b - a < max(1, (n - 1) * 8), (
                f"{name}: ZeRO-1 {b} bus bytes a step against allreduce's {a}")
        # state: floor/ceil(T/n) elements a state tensor on every rank, T over the ranks
        keys = ("momentum_buffer",) if name == "sgd_momentum" else ("exp_avg", "exp_avg_sq")
        for key in keys:
            mine = sum(s[key].numel() for s in opt.optim.state.values())
            assert mine in (T // n, -(-T // n)), f"{name}: {key} holds {mine} elements"
            total = np.array([mine], dtype=np.int64)
            commlib.allreduce(total)
            assert int(total[0]) == T
        opt.close()
    assert not failures, "; ".join(failures)


@pytest.mark.mpi(min_size=2)
def test_negative_control_unreduced_bucket_is_rejected(one_thread_per_rank):
    history, *_ = run("sgd_momentum", steps=2, broken=True)
    assert verdict(history) is not None, "a bucket never reduced passed the parity check"


def _to_everyone(obj):
    """Rank 0's picklable ``obj`` on every rank."""
    buf = io.BytesIO()
    if commlib.get_rank() == 0:
        torch.save(obj, buf)
    data_ = np.frombuffer(buf.getvalue(), dtype=np.uint8).copy()
    size = np.array([data_.size], dtype=np.int64)
    commlib.broadcast(size, 0)
    out = np.zeros(int(size[0]), dtype=np.uint8)
    out[:data_.size] = data_
    commlib.broadcast(out, 0)
    return torch.load(io.BytesIO(out.tobytes()), weights_only=False)


@pytest.mark.mpi
def test_resume_mid_training_continues_exactly(one_thread_per_rank):
    """Adam: after 2 steps, the consolidated state equals torch's Adam's; a fresh optimizer
    over a copy of the model, loaded with it, continues 2 steps bitwise as the original."""
    _, _, _, opt, model, ref_opt = run("adam", steps=2)
    opt.consolidate_state_dict(to=0)
    saved = opt.state_dict() if commlib.get_rank() == 0 else None
    if commlib.get_rank() == 0:
        theirs = ref_opt.state_dict()
        assert sorted(saved["state"]) == sorted(theirs["state"])
        for i, st in theirs["state"].items():
            for key, value in st.items():
                torch.testing.assert_close(saved["state"][i][key], value, rtol=0, atol=TOL)
    saved = _to_everyone(saved)
    twin = make(seed=99)
    twin.load_state_dict(model.state_dict())
    cls, kw, _ = OPTIMIZERS["adam"]
    opt2 = commlib.ZeroRedundancyOptimizer(twin.parameters(), cls, reduce_gradients=True,
                                           bucket_cap_mb=BUCKET_MB, **kw)
    opt2.load_state_dict(saved)
    for step in range(2, 4):
        x, y = local_batch(step)
        for m, o in ((model, opt), (twin, opt2)):
            o.zero_grad()
            loss_fn(m, x, y).backward()
            o.step()
        assert torch.equal(flat(model.parameters()), flat(twin.parameters())), step
    opt.close()
    opt2.close()


@pytest.mark.mpi
def test_clip_grad_norm_matches_torch(one_thread_per_rank):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    cls, kw, _ = OPTIMIZERS["adam"]
    world = gloo_world()
    model = make()
    opt = ours(model, "adam")
    ref = TorchDDP(make(), process_group=world)
    ref_opt = cls(ref.parameters(), **kw)
    history = []
    for step in range(3):
        x, y = local_batch(step)
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        norm = opt.clip_grad_norm_(0.05)
        opt.step()
        ref_opt.zero_grad()
        loss_fn(ref, x, y).backward()
        expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        assert float(expected) > 0.05, "the reference did not clip: the check is void"
        assert abs(float(norm) - float(expected)) <= TOL * float(expected), (step, norm,
                                                                            expected)
        ref_opt.step()
        history.append(replica_errors(flat(model.parameters()),
                                      flat(ref.module.parameters())))
    opt.close()
    assert verdict(history) is None, verdict(history)
