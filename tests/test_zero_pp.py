"""ZeRO++ compressed sharding on commlib.FullyShardedDataParallel (FULL_SHARD):
``weight_quantization="int8"`` (qwZ) and ``gradient_quantization="int8"`` (qgZ).

The bound (commlib.sharded.quantized): an element of a min-max 8-bit block with range
``[lo, hi]`` decodes within ``(hi - lo) / 510`` (+ 8 float32 ulps of ``max |lo|, |hi|``).

* Every step, from the quantized run's own (exact, float64) master weights: the weights
  its forward used are within the bound of the master, block by block of each rank's
  shard, and identical on every rank; its averaged gradient shard is within
  ``mean_r bound(g_r)`` of the exact average of the ranks' local gradients (computed
  with a torch copy of the model at the weights the forward used, all ranks' gradients
  gathered). Negative controls: a decoder that drops the blocks' scales, and a gradient
  exchange that never reduces (each rank keeps its own part), must fail the same check.
* Training against FULL_SHARD in the same job: the loss stays within 1% of FULL_SHARD's
  every step, replicas identical.
* Bytes per step (commlib's counters): the int8 all-gather sends
  ``compressed_nbytes(S, block)`` bytes a call against ``4 S`` for float32 (same calls), the
  qgZ alltoall ``n compressed_nbytes(S, block)`` against the reduce-scatter's ``4 n S``.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import commlib  # noqa: E402
from commlib.sharded import quantized as Q  # noqa: E402
from commlib.sharded import stream  # noqa: E402
from sharded_common import loss_fn, make_model  # noqa: E402

GLOBAL_BATCH = 12
CHUNK_MB = 0.0005
BLOCK = 16       # several blocks per shard of the small model


def batch(step):
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(GLOBAL_BATCH, 10, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)


def mine(t):
    n, r = commlib.get_world_size(), commlib.get_rank()
    per = GLOBAL_BATCH // n
    return t[r * per:(r + 1) * per]


def wrap(model, **kw):
    return commlib.FullyShardedDataParallel(model, "FULL_SHARD", chunk_size_mb=CHUNK_MB,
                                            quantization_block_size=BLOCK, **kw)


def shard_bounds(flat, c):
    """Element-wise bound for chunk ``c``'s flat values quantized shard by shard."""
    S = c.shard_numel
    return torch.cat([Q.error_bound(flat[r * S:(r + 1) * S], BLOCK) for r in range(c.shards)])


def chunk_flat(c, tensors):
    """Chunk ``c``'s layout (padded with zeros) of per-slot tensors ``tensors``."""
    out = torch.zeros(c.padded, dtype=torch.float64)
    for s, t in zip(c.slots, tensors):
        out[s.offset:s.offset + s.numel] = t.detach().double().reshape(-1)
    return out


def nodes_of(n):
    """Emulated node size for hpZ: 2 ranks a node where the world splits evenly, else one
    node (COMMLIB_LOCAL_SIZE)."""
    return 2 if n % 2 == 0 and n > 2 else n


def grad_bound(grads, r, S, bits, nodes):
    """Bound on |our gradient part r - exact mean| (``grads``: every rank's full chunk
    gradient). Flat qgZ: ``mean_q bound(g_q[part r])``; hierarchical (``nodes``: the ranks
    of each node): ``(1/n) sum_v bound(sum_{q in v} g_q[part r])``, 0 with one node (the
    node sums are exact, only they are quantized)."""
    n = len(grads)
    parts = [g[r * S:(r + 1) * S] for g in grads]
    if nodes is None:
        return sum(Q.error_bound(p, BLOCK, bits) for p in parts) / n
    if len(nodes) == 1:
        return torch.zeros(S, dtype=torch.float64)
    return sum(Q.error_bound(sum(parts[q] for q in v), BLOCK, bits) for v in nodes) / n


def excesses(steps=3, grad="int8", nodes=None, **kw):
    """Per step: (max excess of |used weight - master| over its bound, max excess of
    |gradient shard - exact mean| over its bound, used weights identical on all ranks).
    An excess <= 0 is within the bound. ``nodes``: the emulated nodes' ranks, for
    ``gradient_hierarchy="node"`` (None: flat qgZ)."""
    if nodes is not None:
        kw["gradient_hierarchy"] = "node"
    model = wrap(make_model(), weight_quantization="int8", gradient_quantization=grad, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    ref = make_model()
    refp = dict(ref.named_parameters())
    used = {}
    gather = model._gather

    def recording_gather(c):
        gather(c)
        if model._in_forward:
            used[c.index] = c.full.detach().double().clone()
    model._gather = recording_gather
    out = []
    try:
        for step in range(steps):
            x, y = batch(step)
            master = {k: v.clone() for k, v in model.state_dict().items()}   # exact
            used.clear()
            opt.zero_grad()
            loss_fn(model, mine(x), mine(y)).backward()
            w_excess, g_excess = -np.inf, -np.inf
            used_all = []
            for c in model._chunks:
                exact = chunk_flat(c, [master[s.name] for s in c.slots])
                got = used[c.index] if c.shards > 1 else exact
                used_all.append(got)
                w_excess = max(w_excess, float(((got - exact).abs()
                                                - shard_bounds(exact, c)).max()))
                # the reference computes with the weights this forward used
                with torch.no_grad():
                    for s in c.slots:
                        refp[s.name].copy_(got[s.offset:s.offset + s.numel].view(s.shape))
            rows = commlib.allgather(torch.cat(used_all).numpy())
            same = all(np.array_equal(r, rows[0]) for r in rows)
            ref.zero_grad()
            loss_fn(ref, mine(x), mine(y)).backward()
            graded = [c for c in model._chunks if c.requires_grad]
            local = torch.cat([chunk_flat(c, [refp[s.name].grad for s in c.slots])
                               for c in graded])
            everyone = torch.from_numpy(commlib.allgather(local.numpy()))   # (n, sum padded)
            offset = 0
            for c in graded:
                grads = everyone[:, offset:offset + c.padded]
                offset += c.padded
                S, r = c.shard_numel, model.rank
                mean = grads.mean(0)[r * S:(r + 1) * S]
                bound = grad_bound(grads, r, S, grad, nodes) if c.shards > 1 \
                    else torch.zeros(S, dtype=torch.float64)
                err = (c.shard.grad.double() - mean).abs() - bound - 1e-12
                g_excess = max(g_excess, float(err.max()))
            flags = np.array([w_excess, g_excess])
            commlib.allreduce(flags, commlib.ReduceOp.MAX)
            out.append((float(flags[0]), float(flags[1]), same))
            opt.step()
    finally:
        model.close()
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("secondary", [None, "node"])
def test_every_step_within_quantization_bound(secondary, monkeypatch, one_thread_per_rank):
    """qwZ + qgZ (and hpZ: the backward re-gathers inside the node must give the forward's
    weights, or the gradient check fails)."""
    monkeypatch.setattr(commlib.options, "local_size", nodes_of(commlib.get_world_size()))
    for step, (w, g, same) in enumerate(excesses(secondary_shard=secondary)):
        assert same, f"step {step}: the replicas computed with different weights"
        assert w <= 0, f"step {step}: a used weight is {w:.3g} beyond its quantization bound"
        assert g <= 0, f"step {step}: a gradient is {g:.3g} beyond its quantization bound"


def _scale_free(buf, out=None):
    """Broken decoder: the codes without the blocks' (min, max) (codes / 255)."""
    from commlib import kernels
    lay = kernels.read_header(buf)
    codes = buf[lay.data_offset:lay.data_offset + lay.numel]
    vals = codes.float() / 255.0
    if out is None:
        return vals
    out.copy_(vals)
    return out


def _never_reduced(full, group, block, average=True, bits="int8"):
    """Broken qgZ: each rank keeps its own part of its own gradient (quantized)."""
    part = full.reshape(group.size, -1)[group.rank]
    return Q.dequantize(Q.quantize(part, block)).to(full.dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("broken", ["scales_dropped", "never_reduced"])
def test_negative_controls_are_rejected(broken, monkeypatch, one_thread_per_rank):
    if commlib.get_world_size() == 1:
        pytest.skip("one rank: nothing is gathered or exchanged")
    if broken == "scales_dropped":
        monkeypatch.setattr(Q, "dequantize", _scale_free)
    else:
        monkeypatch.setattr(stream, "quantized_reduce_scatter", _never_reduced)
    history = excesses(steps=2)
    col = 0 if broken == "scales_dropped" else 1
    assert max(h[col] for h in history) > 0, f"{broken} passed the bound check"


def hierarchy_nodes(n):
    """Emulated nodes for hierarchical qgZ: 2 x 2 at 4 ranks (the two tiers), else one
    rank a node (n nodes: the inter-node tier alone)."""
    m = 2 if n == 4 else 1
    return m, [list(range(v * m, (v + 1) * m)) for v in range(n // m)]


@pytest.mark.mpi
def test_int4_and_hierarchical_within_quantization_bound(monkeypatch, one_thread_per_rank):
    """qgZ int4 flat, and hierarchical int8 / int4 (intra-node reduce in full precision,
    then the quantized alltoall of node sums): each gradient within its bound every step
    (int4: ``(hi - lo) / 30`` a block). Sensitivity: int4's errors exceed int8's bound
    (the 4-bit path really quantizes at 15 levels); at 4 ranks, an intra-node tier that
    does not reduce (each rank keeps its own parts) must fail the bound."""
    n = commlib.get_world_size()
    m, nodes = hierarchy_nodes(n)
    monkeypatch.setattr(commlib.options, "local_size", m)
    for grad, hier in (("int4", None), ("int8", nodes), ("int4", nodes)):
        for step, (w, g, same) in enumerate(excesses(steps=2, grad=grad, nodes=hier)):
            where = f"{grad} {'hierarchical' if hier else 'flat'} step {step}"
            assert same, f"{where}: the replicas computed with different weights"
            assert w <= 0, f"{where}: a used weight is {w:.3g} beyond its bound"
            assert g <= 0, f"{where}: a gradient is {g:.3g} beyond its bound"
    if n > 1:
        bound = Q.error_bound
        monkeypatch.setattr(Q, "error_bound", lambda x, block, bits="int8": bound(x, block))
        history = excesses(steps=1, grad="int4")
        monkeypatch.setattr(Q, "error_bound", bound)
        assert max(h[1] for h in history) > 0, "int4 errors within int8's bound"
    if m > 1:
        def local_only(t, op, group):   # broken intra-node tier: no reduction
            k = t.numel() // group.size
            return t[group.rank * k:(group.rank + 1) * k].clone()
        monkeypatch.setattr(Q, "reduce_scatter", local_only)
        history = excesses(steps=1, grad="int8", nodes=nodes)
        assert max(h[1] for h in history) > 0, "an unreduced node tier passed the bound"


@pytest.mark.mpi
@pytest.mark.parametrize("broken", [False, True])
def test_trains_like_full_shard(broken, monkeypatch, one_thread_per_rank):
    """qwZ + qgZ against exact FULL_SHARD, same data, same job: loss within 1% each step
    (negative control: the decoder that drops the scales must break it)."""
    if broken:
        if commlib.get_world_size() == 1:
            pytest.skip("one rank: nothing is gathered or exchanged")
        monkeypatch.setattr(Q, "dequantize", _scale_free)
    runs = {}
    for name, kw in (("exact", {}), ("int8", {"weight_quantization": "int8",
                                              "gradient_quantization": "int8"})):
        model = wrap(make_model(), **kw)
        opt = torch.optim.Adam(model.parameters(), lr=0.02)
        losses = []
        x, y = batch(0)          # one batch: the loss must fall
        for step in range(10):
            opt.zero_grad()
            loss = loss_fn(model, mine(x), mine(y))
            loss.backward()
            opt.step()
            mean = np.array([float(loss)])
            commlib.allreduce(mean, commlib.ReduceOp.AVG)
            losses.append(float(mean[0]))
        flat = torch.cat([v.reshape(-1) for v in model.state_dict().values()])
        rows = commlib.allgather(flat.numpy())
        assert all(np.array_equal(r, rows[0]) for r in rows), f"{name}: replicas differ"
        runs[name] = losses
        model.close()
    close = [abs(a - b) <= 0.01 * abs(a) for a, b in zip(runs["exact"], runs["int8"])]
    if broken:
        assert not all(close), "the scale-free decoder trained like FULL_SHARD"
        return
    for step, (a, b) in enumerate(zip(runs["exact"], runs["int8"])):
        assert close[step], f"step {step}: loss {b} vs FULL_SHARD's {a}"
    assert runs["int8"][-1] < runs["int8"][0]


def _bytes_one_step(**kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    fsdp = commlib.FullyShardedDataParallel(model, "FULL_SHARD", chunk_size_mb=1056 * 4 / 2**20,
                                            quantization_block_size=128, **kw)
    x = torch.randn(6, 32)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.01)
    fsdp(x).sum().backward()          # warm-up: learns the first-use order
    opt.step()                        # the shards change, as in training
    opt.zero_grad()
    commlib.stats(reset=True)
    fsdp(x).sum().backward()
    stats = {op: (v["calls"], v["bytes"]) for op, v in commlib.stats(reset=True).items()}
    S = fsdp._chunks[0].shard_numel
    assert all(c.shard_numel == S for c in fsdp._chunks)
    fsdp.close()
    return stats, S


@pytest.mark.mpi
def test_bytes_per_step_against_full_shard(one_thread_per_rank):
    n = commlib.get_world_size()
    if n == 1:
        pytest.skip("one rank: nothing is sent")
    base, S = _bytes_one_step()
    qw, _ = _bytes_one_step(weight_quantization="int8")
    qg, _ = _bytes_one_step(gradient_quantization="int8")
    wire = Q.wire_nbytes(S, 128)
    assert wire == -(-(32 + 8 * -(-S // 128) + S) // 8) * 8   # header, (min, max), codes
    calls, rs_calls = base["allgather"][0], base["reduce_scatter"][0]
    assert set(base) == {"allgather", "reduce_scatter"}
    assert base["allgather"] == (calls, calls * 4 * S) and calls >= 4   # 4 chunks
    assert qw == {"allgather": (calls, calls * wire), "reduce_scatter": base["reduce_scatter"]}
    assert base["reduce_scatter"] == (rs_calls, rs_calls * 4 * n * S) and rs_calls == 4
    assert qg == {"allgather": base["allgather"], "alltoall": (rs_calls, rs_calls * n * wire)}
    if commlib.get_rank() == 0:
        print(f"\nn={n} S={S}: allgather {calls} x {4 * S} B -> {wire} B "
              f"({wire / (4 * S):.4f}); reduce_scatter {rs_calls} x {4 * n * S} B -> "
              f"alltoall {n * wire} B")


@pytest.mark.mpi
def test_int4_and_hierarchical_bytes(monkeypatch, one_thread_per_rank):
    """Counters per step: int4 alltoall ``n wire4(S)`` a chunk; hierarchical: the node's
    full-precision reduce_scatter of ``4 n S`` (m > 1) and the alltoall of ``k`` node sums
    among the k nodes (``k wire(S)``). Inter-node bytes a chunk and rank (printed): the
    flat exchanges send ``n - m`` parts off the node, the hierarchical one ``k - 1``."""
    n = commlib.get_world_size()
    if n == 1:
        pytest.skip("one rank: nothing is sent")
    m, _ = hierarchy_nodes(n)
    k = n // m
    monkeypatch.setattr(commlib.options, "local_size", m)
    base, S = _bytes_one_step()
    rs_calls = base["reduce_scatter"][0]
    w8, w4 = Q.wire_nbytes(S, 128, "int8"), Q.wire_nbytes(S, 128, "int4")
    q4, _ = _bytes_one_step(gradient_quantization="int4")
    assert q4 == {"allgather": base["allgather"], "alltoall": (rs_calls, rs_calls * n * w4)}
    inter = {"FULL_SHARD fp32": (n - m) * 4 * S, "qgZ int8": (n - m) * w8,
             "qgZ int4": (n - m) * w4}
    for bits, wire in (("int8", w8), ("int4", w4)):
        h, _ = _bytes_one_step(gradient_quantization=bits, gradient_hierarchy="node")
        expect = {"allgather": base["allgather"], "alltoall": (rs_calls, rs_calls * k * wire)}
        if m > 1:
            expect["reduce_scatter"] = (rs_calls, rs_calls * 4 * n * S)
        assert h == expect, (bits, h, expect)
        inter[f"hierarchical qgZ {bits}"] = (k - 1) * wire
    if commlib.get_rank() == 0:
        print(f"\nn={n}, {k} nodes of {m}, S={S}: inter-node bytes a chunk and rank: " +
              ", ".join(f"{name} {b} ({b / inter['FULL_SHARD fp32']:.3f}x)"
                        for name, b in inter.items()))


def _train_exact(steps, broken=False, **kw):
    model = wrap(make_model(), **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    gather = model._gather
    if broken:   # the node's copy taken one element off: backward sees other weights
        def shifted(c):
            gather(c)
            if model._in_forward and c.index in model._secondary:
                t, v = model._secondary[c.index]
                model._secondary[c.index] = (t.roll(1), v)
        model._gather = shifted
    states = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss_fn(model, mine(x), mine(y)).backward()
        opt.step()
        states.append(torch.cat([v.reshape(-1) for v in model.state_dict().values()]))
    secondary = model.memory_bytes()["secondary"]
    model.close()
    return states, secondary


@pytest.mark.mpi
@pytest.mark.parametrize("broken", [False, True])
def test_secondary_shard_is_exact(broken, monkeypatch, one_thread_per_rank):
    """hpZ alone changes no value: bitwise FULL_SHARD every step (negative control: a
    node copy one element off must not be)."""
    n = commlib.get_world_size()
    if broken and n == 1:
        pytest.skip("one rank: no chunk is sharded")
    m = nodes_of(n)
    monkeypatch.setattr(commlib.options, "local_size", m)
    ref, _ = _train_exact(3)
    got, secondary = _train_exact(3, broken, secondary_shard="node")
    equal = [bool(torch.equal(a, b)) for a, b in zip(ref, got)]
    if broken:
        assert not all(equal), "a shifted node copy trained like FULL_SHARD"
        return
    assert all(equal), f"hpZ differs from FULL_SHARD at steps {equal}"
    model = wrap(make_model())
    expect = sum(c.padded // m * 8 for c in model._chunks if c.shards > 1)
    model.close()
    assert secondary <= expect and (secondary > 0 or n == 1)


@pytest.mark.mpi
def test_secondary_shard_bytes(monkeypatch, one_thread_per_rank):
    """The backward re-gathers of hpZ run on the node (m ranks, P = padded / m a rank)."""
    n = commlib.get_world_size()
    if n == 1:
        pytest.skip("one rank: nothing is sent")
    m = nodes_of(n)
    monkeypatch.setattr(commlib.options, "local_size", m)
    base, S = _bytes_one_step()
    hp, _ = _bytes_one_step(secondary_shard="node")
    P = S * n // m
    calls = base["allgather"][0]
    forward = 4   # one gather of each of the 4 chunks, the rest are backward's
    assert hp == {"allgather": (calls, forward * 4 * S + (calls - forward) * 4 * P),
                  "reduce_scatter": base["reduce_scatter"]}
    if commlib.get_rank() == 0:
        print(f"\nhpZ n={n} m={m}: {calls - forward} backward gathers of {4 * S} B over "
              f"{n} ranks -> {4 * P} B inside the node")


def test_bad_arguments():
    for kw, name in ((dict(weight_quantization="int4"), "weight_quantization"),
                     (dict(gradient_quantization="fp8"), "gradient_quantization"),
                     (dict(weight_quantization=True), "weight_quantization"),
                     (dict(quantization_block_size=0), "quantization_block_size"),
                     (dict(quantization_block_size=2.0), "quantization_block_size"),
                     (dict(sharding_strategy="SHARD_GRAD_OP", weight_quantization="int8"),
                      "weight_quantization"),
                     (dict(sharding_strategy="NO_SHARD", gradient_quantization="int8"),
                      "gradient_quantization"),
                     (dict(secondary_shard="rack"), "secondary_shard"),
                     (dict(gradient_quantization="int4", quantization_block_size=15),
                      "quantization_block_size"),
                     (dict(gradient_quantization="int8", gradient_hierarchy="rack"),
                      "gradient_hierarchy"),
                     (dict(gradient_hierarchy="node"), "gradient_hierarchy"),
                     (dict(sharding_strategy="SHARD_GRAD_OP", secondary_shard="node"),
                      "secondary_shard")):
        with pytest.raises(ValueError, match=name):
            commlib.FullyShardedDataParallel(make_model(), **kw)
    # SHARD_GRAD_OP takes qgZ
    commlib.FullyShardedDataParallel(make_model(), "SHARD_GRAD_OP",
                                     gradient_quantization="int8").close()
