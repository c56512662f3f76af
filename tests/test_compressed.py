"""The compressed allreduce against a numpy simulation of the same quantization (bit for
bit), and its byte counts."""
import numpy as np
import pytest

import commlib
from commlib import ReduceOp
from commlib.primitives import CompressionState, compressed_allreduce

CHUNK = 64


F = np.float32


def quantize(x, chunk):
    """Independent numpy version of kernels' min-max uint8, from the formulas documented in
    kernels/_arith.py (float32 throughout)."""
    x = x.astype(F)
    q = np.zeros(x.shape, np.uint8)
    params = []
    for s in range(0, len(x), chunk):
        c = x[s:s + chunk]
        lo, hi = c.min() + F(0), c.max() + F(0)
        rng = F(hi - lo)
        if rng != 0:
            pre = F(2.0 ** 64) if rng < F(2.0 ** -64) else F(1)
            scale = F(255) / (rng * pre)
            q[s:s + chunk] = np.rint(((c - lo) * pre) * scale).astype(np.uint8)
        params.append((lo, hi, rng))
    return q, params


def dequantize(q, params, chunk):
    out = np.empty(q.shape, F)
    for i, (lo, hi, rng) in enumerate(params):
        s = i * chunk
        v = lo + (q[s:s + chunk].astype(F) * F(1.0 / 255.0)) * rng
        out[s:s + chunk] = np.minimum(v, hi)
    return out


def roundtrip(x, chunk):
    return dequantize(*quantize(x, chunk), chunk)


def simulate(inputs, average, chunk):
    """The algorithm of commlib.primitives.compressed on one rank, for all ranks."""
    n, length = len(inputs), len(inputs[0])
    part = -(-length // n)
    padded = [np.concatenate([x, np.full(n * part - length, x[-1], np.float32)])
              for x in inputs]
    result = []
    for j in range(n):
        acc = np.zeros(part, np.float32)
        for r in range(n):
            acc += roundtrip(padded[r][j * part:(j + 1) * part], chunk)
        if average:
            acc /= np.float32(n)
        result.append(roundtrip(acc, chunk))
    return np.concatenate(result)[:length]


def inputs(length, seed=0):
    n = commlib.get_world_size()
    return [np.random.default_rng(seed + r).standard_normal(length).astype(np.float32)
            * (r + 1) for r in range(n)]


@pytest.mark.mpi
@pytest.mark.parametrize("length", [1, 7, 1000, 4099])
@pytest.mark.parametrize("op", [ReduceOp.AVG, ReduceOp.SUM])
def test_matches_numpy_simulation_bit_for_bit(length, op):
    rank, n = commlib.get_rank(), commlib.get_world_size()
    xs = inputs(length, seed=length)
    x = xs[rank].copy()
    compressed_allreduce(x, op=op, method="minmax_uint8", chunk_size=CHUNK)
    if n == 1:
        np.testing.assert_array_equal(x, xs[0])
        return
    np.testing.assert_array_equal(x, simulate(xs, op is ReduceOp.AVG, CHUNK))


@pytest.mark.mpi
def test_torch_and_numpy_agree_and_every_rank_is_identical():
    torch = pytest.importorskip("torch")
    rank = commlib.get_rank()
    xs = inputs(3000, seed=5)
    a = xs[rank].copy()
    t = torch.tensor(xs[rank]).reshape(30, 100)
    compressed_allreduce(a)
    compressed_allreduce(t)
    np.testing.assert_array_equal(t.reshape(-1).numpy(), a)
    everyone = commlib.allgather(a)
    assert (everyone == everyone[0]).all()


@pytest.mark.mpi(min_size=2)
def test_bus_bytes_are_about_a_quarter_of_an_allreduce():
    x = inputs(1 << 16)[commlib.get_rank()]
    commlib.stats(reset=True)
    commlib.allreduce(x.copy())
    plain = commlib.stats(reset=True)["allreduce"]["bus_bytes"]
    compressed_allreduce(x.copy(), chunk_size=2048)
    counted = commlib.stats(reset=True)
    assert set(counted) == {"alltoall", "allgather"}
    ratio = sum(v["bus_bytes"] for v in counted.values()) / plain
    assert 0.25 <= ratio <= 0.27, ratio


@pytest.mark.mpi(min_size=2)
def test_sign1_error_feedback_tracks_the_mean_over_steps():
    rank = commlib.get_rank()
    state = CompressionState()
    total_sent, total_true = 0.0, 0.0
    for step in range(200):
        xs = inputs(512, seed=100 + step)
        x = xs[rank].copy()
        compressed_allreduce(x, method="sign1", state=state, chunk_size=128)
        total_sent = total_sent + x.astype(np.float64)
        total_true = total_true + np.mean(xs, axis=0).astype(np.float64)
    # Without error feedback the gap would grow with the number of steps; with it, the
    # residuals bound it.
    gap = np.abs(total_sent - total_true).max()
    assert gap < 25, gap
    commlib.stats(reset=True)
    compressed_allreduce(x, method="sign1", state=state, chunk_size=128)
    sent = sum(v["bytes"] for v in commlib.stats(reset=True).values())
    # 1 bit per element plus a scale per chunk and a 32-byte header per part: far below
    # the 4 bytes per element of float32, even at this small size.
    assert sent < 0.2 * 512 * 4, sent


@pytest.mark.mpi
def test_hierarchical_is_close_to_flat(monkeypatch):
    monkeypatch.setattr(commlib.options, "local_size", 2)
    group = commlib.new_group()
    rank = commlib.get_rank()
    xs = inputs(2000, seed=9)
    x = xs[rank].copy()
    compressed_allreduce(x, group=group, hierarchical=True)
    exact = np.mean(xs, axis=0)
    assert np.abs(x - exact).max() <= (exact.max() - exact.min()) / 100 + 1e-6
    everyone = commlib.allgather(x)
    assert (everyone == everyone[0]).all()


def test_bad_arguments():
    with pytest.raises(ValueError, match="argument 'op'"):
        compressed_allreduce(np.zeros(4, np.float32), op=ReduceOp.MAX)
    with pytest.raises(ValueError, match="CompressionState"):
        compressed_allreduce(np.zeros(4, np.float32), method="sign1")
    with pytest.raises(TypeError, match="floating point"):
        compressed_allreduce(np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="'method'"):
        compressed_allreduce(np.zeros(4, np.float32), method="zip")
