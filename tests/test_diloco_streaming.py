"""``streaming_diloco`` against torchft's Streaming DiLoCo step written with torch (per
fragment: the pseudo-gradient taken tau iterations before the outer step, averaged, the
fragment's global weights restored and stepped by ``torch.optim.SGD``, the replica merged
with ``lerp(global, local, alpha)``), float64, every replica after every step; the bytes
(total as DiLoCo's, the peak one fragment's); convergence of every replica with int8 and
int4 pseudo-gradients, with negative controls; the int4 allreduce's own checks."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")
import torch.nn.functional as F  # noqa: E402

import commlib  # noqa: E402
from algo_harness import batch_indices, digits, model, param_groups, train  # noqa: E402
from commlib.algorithms import int4  # noqa: E402
from commlib.algorithms.streaming_diloco import StreamingDiLoCo, split_layers  # noqa: E402
from commlib.base import accounting  # noqa: E402
from commlib.base.reduce_ops import ReduceOp  # noqa: E402
from commlib.primitives import allreduce  # noqa: E402
from test_diloco import flat, gap, inner  # noqa: E402
from test_diloco import our_run as diloco_run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")

STEPS = 12


def reference_run(cfg):
    rank, n = commlib.get_rank(), commlib.get_world_size()
    x, y = digits(torch.float64)
    module = model(torch.float64)
    named = list(module.named_parameters())
    h, nf, tau, alpha = cfg["sync_every"], cfg["num_fragments"], cfg["fragment_sync_delay"], \
        cfg["fragment_update_alpha"]
    period = h // nf
    frags = [[named[i][1] for i in idx] for idx in split_layers(named, nf)]
    opt = inner(cfg["inner"], param_groups(module))
    original = [[p.detach().clone() for p in ps] for ps in frags]
    outer = [torch.optim.SGD(ps, lr=cfg["outer_lr"], momentum=cfg["outer_momentum"],
                             nesterov=True) for ps in frags]
    inflight, out = None, []
    for step in range(STEPS):
        idx = batch_indices(rank, n, step)
        opt.zero_grad()
        F.cross_entropy(module(x[idx]), y[idx]).backward()
        opt.step()
        t = step + 1
        with torch.no_grad():
            if (t + tau) % h % period == 0:
                f = (t + tau) % h // period
                grads = [o - p for o, p in zip(original[f], frags[f])]
                for g in grads:
                    allreduce(g, op=ReduceOp.AVG)
                inflight = (f, t, grads)
            if inflight is not None and inflight[1] + tau == t:
                f, _, grads = inflight
                local = [p.detach().clone() for p in frags[f]]
                for p, o, g in zip(frags[f], original[f], grads):
                    p.copy_(o)
                    p.grad = g
                outer[f].step()
                outer[f].zero_grad()
                original[f] = [p.detach().clone() for p in frags[f]]
                for p, loc in zip(frags[f], local):
                    p.lerp_(loc, alpha)
                inflight = None
        out.append(flat(module))
    return out


def our_run(cfg):
    return diloco_run(cfg, algorithm=StreamingDiLoCo(
        **{k: v for k, v in cfg.items() if k != "inner"}), min_buckets=0)


BASE = dict(sync_every=4, num_fragments=2, fragment_sync_delay=0, fragment_update_alpha=0.0,
            outer_lr=0.7, outer_momentum=0.9, inner="sgd")
CASES = [
    dict(BASE),
    dict(BASE, fragment_sync_delay=1, fragment_update_alpha=0.5),
    dict(BASE, sync_every=6, num_fragments=3, fragment_sync_delay=1, inner="adam"),
    dict(BASE, sync_every=6, num_fragments=2, fragment_sync_delay=2, fragment_update_alpha=1.0),
    dict(BASE, sync_every=3, num_fragments=3, fragment_update_alpha=0.25, outer_lr=1.0),
]


@pytest.mark.mpi
def test_streaming_diloco_matches_the_torch_formulation_after_every_step():
    """Five configurations (H 3-6, F 2-3, tau 0-2, alpha 0-1, SGD or Adam inside) x 12
    steps, every rank's own replica; negative control: the reference with another alpha."""
    for k, cfg in enumerate(CASES):
        d = gap(our_run(cfg), reference_run(cfg))
        print(f"streaming_diloco vs torch formulation, case {k}: largest difference {d:.3g}")
        assert d <= 1e-12, f"case {k} {cfg}: differs from the torch formulation by {d:.3g}"
    cfg = CASES[1]
    assert gap(our_run(cfg), reference_run(dict(cfg, fragment_update_alpha=0.0))) > 1e-6


def per_step_bus(algorithm, steps=17, **kwargs):
    """Bus bytes of each iteration's exchange (counted at the next optimizer step: the
    exchange runs before the next forward): iterations 1-16, four whole periods."""
    seen = []

    def on_step(step, ddp):
        seen.append(accounting.total(commlib.stats(), "bus_bytes"))

    out = train(algorithm, steps=steps, on_step=on_step, **kwargs)
    return [b - a for a, b in zip(seen, seen[1:])], out


@pytest.mark.mpi
def test_bytes_total_as_diloco_peak_one_fragment():
    if commlib.get_world_size() == 1:
        pytest.skip("no traffic on one rank")
    h = 4
    plain, _ = per_step_bus("diloco", sync_every=h)
    streamed, _ = per_step_bus("streaming_diloco", sync_every=h, num_fragments=2)
    sizes = [sum(p.numel() for i, p in enumerate(model().parameters()) if i in idx)
             for idx in split_layers(list(model().named_parameters()), 2)]
    # bus bytes are whole per call (2 (n-1)/n of the bytes, rounded): equal to 1e-3
    assert sum(plain) > 0 and sum(streamed) == pytest.approx(sum(plain), rel=1e-3)
    assert max(streamed) / max(plain) == pytest.approx(max(sizes) / sum(sizes), rel=1e-3)
    assert sum(1 for b in streamed if b) == 2 * sum(1 for b in plain if b)


class DropFragmentStreaming(StreamingDiLoCo):
    """Broken: fragment 0 (the input layer) is never synchronized."""

    def _launch(self, ctx, f, t):
        if f != 0:
            super()._launch(ctx, f, t)


_ref = {}


@pytest.mark.mpi
def test_streaming_diloco_converges_per_replica_quantized():
    """int8 without error feedback, int4 with it; negative control: fragment 0 never
    synchronized (with int4)."""
    n = commlib.get_world_size()
    if not _ref:
        _ref.update(train("gradient_allreduce", steps=60))
    cfg = dict(sync_every=4, num_fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.0,
               outer_lr=0.7, outer_momentum=0.5)

    def check(out):
        assert out["loss"] <= _ref["loss"] * 1.5 + 0.02, (out["losses"], _ref["loss"])

    check(train("streaming_diloco", steps=60, quantize="int8", **cfg))
    check(train("streaming_diloco", steps=60, quantize="int4", error_feedback=True, **cfg))
    if n > 1:
        with pytest.raises(AssertionError):
            check(train(DropFragmentStreaming(quantize="int4", **cfg), steps=60))


@pytest.mark.mpi
def test_int4_allreduce_averages_within_its_bound_identically_everywhere():
    """1M elements: the result within two quantization steps of the mean, bitwise the same
    on every rank, an eighth of a float32 allreduce's bus bytes (plus the headers); a
    NaN on one rank makes its chunk NaN everywhere and nothing else."""
    rank, n = commlib.get_rank(), commlib.get_world_size()
    group = commlib.primitives.new_group()
    try:
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(1 << 20, generator=g)
        exact = x.clone()
        allreduce(exact, op=ReduceOp.AVG)
        got = x.clone()
        commlib.stats(reset=True)
        int4.allreduce(got, group, chunk_size=2048)
        wire = accounting.total(commlib.stats(reset=True), "bus_bytes")
        every = commlib.allgather(got.numpy())
        assert all((e == got.numpy()).all() for e in every)
        if n == 1:
            assert torch.equal(got, x)
            return
        span = float(x.max() - x.min())
        assert float((got - exact).abs().max()) <= 2 * span / 15
        assert float((got - exact).abs().max()) > 0
        full = 2 * (n - 1) / n * x.numel() * 4
        assert wire / full == pytest.approx(1 / 8 * (1 + 16 / 2048), rel=0.01)
        y = x.clone()
        if rank == n - 1:
            y[5000] = float("nan")
        int4.allreduce(y, group)
        bad = torch.isnan(y)
        assert int(bad.sum()) == 2048 and bool(bad[4096:6144].all()), int(bad.sum())
    finally:
        group.free()


def test_streaming_diloco_rejects_bad_arguments():
    for bad, match in ((dict(num_fragments=3), "num_fragments"),
                       (dict(fragment_sync_delay=8), "fragment_sync_delay"),
                       (dict(fragment_update_alpha=1.5), "fragment_update_alpha"),
                       (dict(quantize="int2"), "quantize"),
                       (dict(error_feedback=True), "error_feedback")):
        with pytest.raises(ValueError, match=match):
            StreamingDiLoCo(**bad)
    with pytest.raises(ValueError, match="layers"):
        split_layers(list(model().named_parameters()), 4)
    groups = split_layers(list(model().named_parameters()), 3)
    assert groups == [[0, 1], [2, 3], [4, 5]]
