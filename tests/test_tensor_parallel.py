"""Tensor-parallel layers (multi-rank): outputs and gradients equal the unsharded layer
(float64, 1e-12); a SplitBrain-sharded VGG-style net trains to the unsharded parameters
(1e-10 after 10 SGD steps); a broken sharding is rejected by the same checks."""
import copy

import numpy as np
import pytest
import torch

import commlib
from commlib.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    allreduce_gradients,
    shard_model,
)

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("one_thread_per_rank")]


def data(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def full_grad(layer):
    """The whole weight gradient of a sharded layer (collective)."""
    saved = layer.weight.data
    layer.weight.data = layer.weight.grad
    try:
        return layer.full_weight()
    finally:
        layer.weight.data = saved


@pytest.mark.parametrize("kind", ["column", "column-local", "row", "row-parallel-input"])
def test_layer_equals_linear(kind):
    group = commlib.world()
    torch.manual_seed(0)
    ref = torch.nn.Linear(7, 11).double()  # 7, 11: uneven blocks at 2, 3 and 4 ranks
    x = data(1, 5, 7).requires_grad_(True)
    if kind.startswith("column"):
        layer = ColumnParallelLinear.from_linear(ref, group, gather_output=kind == "column")
    else:
        layer = RowParallelLinear.from_linear(ref, group, kind == "row-parallel-input")
    xin = x
    if kind == "row-parallel-input":
        xin = commlib.parallel.layers._ScatterToGroup.apply(x, group)
    y = layer(xin)
    want = ref(x)
    g = data(2, 5, 11)
    if kind == "column-local":
        want = want[..., layer.start:layer.start + layer.local]
        g = g[..., layer.start:layer.start + layer.local]
    torch.testing.assert_close(y, want, rtol=0, atol=1e-12)
    (y * g).sum().backward()
    xg = x.grad.clone()
    x.grad = None
    (want * g).sum().backward()
    if kind != "column-local":  # a local slice's input gradient is partial by design
        torch.testing.assert_close(xg, x.grad, rtol=0, atol=1e-12)
    if kind == "column-local":
        torch.testing.assert_close(layer.weight.grad,
                                   ref.weight.grad[layer.start:layer.start + layer.local],
                                   rtol=0, atol=1e-12)
    else:
        torch.testing.assert_close(full_grad(layer), ref.weight.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(layer.full_weight(), ref.weight, rtol=0, atol=0)


def vgg(seed=0):
    """A small VGG-style net: two conv blocks (replicated), three big FC layers."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 2 * 2, 30), torch.nn.ReLU(),
        torch.nn.Linear(30, 30), torch.nn.ReLU(),
        torch.nn.Linear(30, 10)).double()


def full_params(model):
    """Every parameter of a (possibly sharded) model as the unsharded tensors."""
    out = []
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            out.append(m.full_weight())
            if m.bias is not None:
                b = m.bias.detach()
                if isinstance(m, ColumnParallelLinear):
                    b = commlib.parallel.layers._gather_last(b.contiguous(), m.group)
                out.append(b)
        elif not list(m.children()):
            out += [p.detach() for p in m.parameters()]
    return out


def train(model, steps=10, lr=0.05):
    for step in range(steps):
        x, y = data(10 + step, 6, 3, 8, 8), torch.arange(6) % 10
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return model


def max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a, b))


def test_shard_model_vgg_trains_like_unsharded():
    n = commlib.get_world_size()
    ref = vgg()
    model = shard_model(copy.deepcopy(ref), min_params=200)
    kinds = [type(m).__name__ for m in model]
    # FC pairs (Linear, ReLU, Linear) -> column + row; the last big Linear -> gathered column
    assert kinds[7] == "ColumnParallelLinear" and not model[7].gather_output
    assert kinds[9] == "RowParallelLinear" and model[9].input_is_parallel
    assert kinds[11] == "ColumnParallelLinear" and model[11].gather_output
    assert kinds[0] == "Conv2d"
    x = data(3, 6, 3, 8, 8)
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=1e-12)
    sharded = sum(p.numel() for p in model.parameters())
    whole = sum(p.numel() for p in ref.parameters())
    assert n == 1 or sharded < whole
    train(ref)
    train(model)
    assert max_diff(full_params(model), full_params(ref)) < 1e-10


def test_negative_control_broken_shard():
    """A sharding whose partial products are not all-reduced must fail the same check."""
    if commlib.get_world_size() == 1:
        pytest.skip("one rank holds the whole layer")
    ref = vgg()
    broken = shard_model(copy.deepcopy(ref), min_params=200)
    broken[9].forward = lambda x: torch.nn.functional.linear(x, broken[9].weight,
                                                             broken[9].bias)
    x = data(3, 6, 3, 8, 8)
    err = (broken(x) - ref(x)).abs().max().item()
    assert err > 1e-10
    train(ref)
    train(broken)
    assert max_diff(full_params(broken), full_params(ref)) > 1e-10


def test_min_params_and_bad_input():
    model = shard_model(vgg(), min_params=10 ** 6)
    assert not any(isinstance(m, (ColumnParallelLinear, RowParallelLinear))
                   for m in model.modules())
    with pytest.raises(ValueError, match="min_params"):
        shard_model(vgg(), min_params=0)
    with pytest.raises(TypeError, match="model"):
        shard_model("vgg")


def test_data_parallel_gradients_over_topology():
    n = commlib.get_world_size()
    if n not in (2, 4):
        pytest.skip("tp=2 needs an even world")
    topo = commlib.Topology(tp=2)
    tp, dp = topo.group("tp"), topo.group("dp")
    ref = vgg(1)
    model = shard_model(copy.deepcopy(ref), tp, min_params=200)
    # each dp replica its own data, the same within its tp group
    x = data(20 + topo.coord.dp, 4, 3, 8, 8)
    y = torch.arange(4) % 10
    torch.nn.functional.cross_entropy(model(x), y).backward()
    allreduce_gradients(model, commlib.world(), dp)
    # reference: average of the replicas' gradients
    grads = []
    for d in range(topo.sizes["dp"]):
        r = copy.deepcopy(ref)
        torch.nn.functional.cross_entropy(r(data(20 + d, 4, 3, 8, 8)), y).backward()
        grads.append([p.grad for p in r.parameters()])
    avg = [sum(g) / len(grads) for g in zip(*grads)]
    for p, q in zip(model[0].parameters(), avg[:2]):
        torch.testing.assert_close(p.grad, q, rtol=0, atol=1e-12)
    layer = model[7]
    torch.testing.assert_close(layer.weight.grad,
                               avg[4][layer.start:layer.start + layer.local], rtol=0,
                               atol=1e-12)
    topo.free()


def test_vocab_parallel_embedding_and_cross_entropy():
    from commlib.parallel import VocabParallelEmbedding, parallel_cross_entropy
    group = commlib.world()
    torch.manual_seed(0)
    emb = torch.nn.Embedding(13, 5).double()  # 13: uneven blocks
    ids = torch.tensor([[0, 12, 5], [7, 3, 12]])
    layer = VocabParallelEmbedding.from_embedding(emb, group)
    out = layer(ids)
    want = emb(ids)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    g = data(4, 2, 3, 5)
    (out * g).sum().backward()
    (want * g).sum().backward()
    torch.testing.assert_close(layer.weight.grad,
                               emb.weight.grad[layer.start:layer.start + layer.local],
                               rtol=0, atol=1e-12)
    # sharded classifier + cross-entropy against the whole logits
    head = torch.nn.Linear(5, 13).double()
    x = data(5, 6, 5)
    target = torch.tensor([0, 12, 4, 7, 7, 1])
    col = ColumnParallelLinear.from_linear(head, group, gather_output=False)
    loss = parallel_cross_entropy(col(x), target, group)
    ref = torch.nn.functional.cross_entropy(head(x), target)
    assert abs(loss.item() - ref.item()) < 1e-12
    loss.backward()
    ref.backward()
    torch.testing.assert_close(full_grad(col), head.weight.grad, rtol=0, atol=1e-12)
    # negative control: each rank's loss over its own block only is not the loss (the
    # targets made local to the block, since the whole vocabulary's ids now raise)
    if group.size > 1:
        alone_group = commlib.new_subgroup([commlib.get_rank()])
        with pytest.raises(IndexError, match="'target'"):
            parallel_cross_entropy(col(x).detach(), target, alone_group,
                                   vocab_size=col.local)
        alone = parallel_cross_entropy(col(x).detach(), target % col.local, alone_group,
                                       vocab_size=col.local)
        assert abs(alone.item() - ref.item()) > 1e-6
        alone_group.free()


def test_ddp_along_the_data_parallel_axis():
    """Our DDP over topo.group("dp") on a tensor-sharded model: every tp rank sees the
    same data, so replicated gradients agree within the tp group and each parameter (shard
    or replicated) is averaged over the ranks holding the same copy."""
    n = commlib.get_world_size()
    if n not in (2, 4):
        pytest.skip("tp=2 needs an even world")
    topo = commlib.Topology(tp=2)
    ref = vgg(2)
    model = shard_model(copy.deepcopy(ref), topo.group("tp"), min_params=200)
    ddp = commlib.DistributedDataParallel(model, process_group=topo.group("dp"))
    y = torch.arange(4) % 10
    x = data(30 + topo.coord.dp, 4, 3, 8, 8)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    grads = []
    for d in range(topo.sizes["dp"]):
        r = copy.deepcopy(ref)
        torch.nn.functional.cross_entropy(r(data(30 + d, 4, 3, 8, 8)), y).backward()
        grads.append([p.grad for p in r.parameters()])
    avg = [sum(g) / len(grads) for g in zip(*grads)]
    torch.testing.assert_close(model[0].weight.grad, avg[0], rtol=0, atol=1e-12)
    layer = model[7]
    torch.testing.assert_close(layer.weight.grad,
                               avg[4][layer.start:layer.start + layer.local], rtol=0,
                               atol=1e-12)
    del ddp
    topo.free()


def agree(ok, message):
    """Fail on every rank when any rank failed (no rank runs ahead into the next test's
    collectives)."""
    flags = commlib.allgather(np.array([0 if ok else 1]))[:, 0]
    if flags.any():
        raise AssertionError(f"rank {commlib.get_rank()}: failed on ranks "
                             f"{np.nonzero(flags)[0].tolist()}; here: {'' if ok else message}")


def raises_everywhere(exc, match, fn):
    """``fn()`` raises ``exc`` matching ``match`` on this rank; agreed over the world."""
    try:
        fn()
        got = "no exception"
    except exc as e:
        import re
        got = None if re.search(match, str(e)) else f"{exc.__name__}: {e}"
    except Exception as e:  # noqa: BLE001
        got = f"{type(e).__name__}: {e}"
    agree(got is None, f"expected {exc.__name__} matching {match!r}, got {got}")


def test_parallel_cross_entropy_ignore_index_reduction_smoothing():
    """Issue 19, item 6: ignore_index (default -100), reduction and label_smoothing as
    torch; targets outside the vocabulary raise IndexError on every rank."""
    from commlib.parallel import parallel_cross_entropy
    group = commlib.world()
    torch.manual_seed(3)
    head = torch.nn.Linear(5, 13).double()
    x = data(6, 8, 5)
    target = torch.tensor([0, -100, 12, 4, -100, 7, 7, 1])
    col = ColumnParallelLinear.from_linear(head, group, gather_output=False)
    problems = []
    for kwargs in [{}, {"reduction": "sum"}, {"reduction": "none"},
                   {"label_smoothing": 0.2}, {"ignore_index": 7, "reduction": "sum"},
                   {"ignore_index": 7, "label_smoothing": 0.5, "reduction": "none"}]:
        t = target.clone()
        if "ignore_index" in kwargs:
            t[t == -100] = 3
        col.zero_grad()
        head.zero_grad()
        loss = parallel_cross_entropy(col(x), t, group, **kwargs)
        ref = torch.nn.functional.cross_entropy(head(x), t, **kwargs)
        w = data(7, *ref.shape, 1)[..., 0]
        (loss * w).sum().backward()
        (ref * w).sum().backward()
        if not torch.allclose(loss, ref, rtol=0, atol=1e-12):
            problems.append(f"{kwargs}: loss {loss.tolist()} != {ref.tolist()}")
        if not torch.allclose(full_grad(col), head.weight.grad, rtol=0, atol=1e-12):
            problems.append(f"{kwargs}: gradients differ")
    agree(not problems, problems)
    for bad in (torch.tensor([0, 13, 1, 2, 3, 4, 5, 6]), torch.tensor([0, -1, 1, 2, 3, 4, 5, 6])):
        raises_everywhere(IndexError, r"'target'.*\[0, 13\)",
                          lambda: parallel_cross_entropy(col(x), bad, group))
    raises_everywhere(ValueError, "'reduction'",
                      lambda: parallel_cross_entropy(col(x), target, group, reduction="avg"))
    raises_everywhere(ValueError, "'label_smoothing'",
                      lambda: parallel_cross_entropy(col(x), target, group,
                                                     label_smoothing=1.5))
    raises_everywhere(TypeError, "'target'",
                      lambda: parallel_cross_entropy(col(x), torch.rand(8, 13), group))


def test_vocab_parallel_embedding_out_of_range_padding_max_norm():
    """Issue 19, items 7 and 20: out-of-range ids raise IndexError on every rank naming
    'ids' and the range; padding_idx and max_norm as torch.nn.Embedding."""
    from commlib.parallel import VocabParallelEmbedding
    group = commlib.world()
    torch.manual_seed(4)
    emb = torch.nn.Embedding(13, 5, padding_idx=-3, max_norm=1.5, norm_type=2.0).double()
    layer = VocabParallelEmbedding.from_embedding(emb, group)
    for bad in ([[0, 13]], [[-1, 2]]):
        raises_everywhere(IndexError, r"'ids'.*\[0, 13\)", lambda: layer(torch.tensor(bad)))
    problems = []
    if layer.padding_idx != 10:
        problems.append(f"padding_idx {layer.padding_idx}")
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (layer, emb))
    for step in range(3):
        ids = torch.tensor([[0, 10, 12, 5], [10, 7, 3, 12]]) if step % 2 == 0 else \
            torch.tensor([[10, 1, 4, 4]])
        g = data(8 + step, *ids.shape, 5)
        opt.zero_grad()
        ref_opt.zero_grad()
        out, want = layer(ids), emb(ids)
        if not torch.allclose(out, want, rtol=0, atol=1e-12):
            problems.append(f"step {step}: output differs")
        (out * g).sum().backward()
        (want * g).sum().backward()
        sl = slice(layer.start, layer.start + layer.local)
        if not torch.allclose(layer.weight.grad, emb.weight.grad[sl], rtol=0, atol=1e-12):
            problems.append(f"step {step}: gradient differs")
        opt.step()
        ref_opt.step()
        if not torch.allclose(layer.weight.detach(), emb.weight.detach()[sl], rtol=0,
                              atol=1e-12):
            problems.append(f"step {step}: weights differ (renorm or padding row)")
    agree(not problems, problems)
    raises_everywhere(ValueError, "'padding_idx'",
                      lambda: VocabParallelEmbedding(13, 5, group, padding_idx=13))


def tied_lm(seed=0, vocab=11, width=8):
    """An embedding, a body, and a head whose weight is the embedding's."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, width),
                                torch.nn.Linear(width, width), torch.nn.Tanh(),
                                torch.nn.Linear(width, vocab, bias=False)).double()
    model[3].weight = model[0].weight
    return model


def test_shard_model_keeps_tied_weights_and_narrow_layers():
    """Issue 19, item 8: a head tied to the embedding stays a replicated Linear holding the
    embedding's weight (the same function after 3 steps); a Linear too narrow to split over
    the group is left replicated instead of raising."""
    ref = tied_lm()
    model = shard_model(copy.deepcopy(ref), min_params=1)
    problems = []
    if type(model[3]) is not torch.nn.Linear or model[3].weight is not model[0].weight:
        kept = getattr(model[3], "weight", None) is model[0].weight
        problems.append(f"the tied head became {type(model[3]).__name__}, tie "
                        f"{'kept' if kept else 'broken'}")
    if commlib.get_world_size() > 1 and type(model[1]).__name__ != "ColumnParallelLinear":
        problems.append(f"the untied body layer is {type(model[1]).__name__}")
    ids = torch.tensor([[1, 4, 7], [10, 0, 3]])
    for m in (ref, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.3)
        for step in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(ids).reshape(-1, 11),
                                              torch.arange(6) % 11).backward()
            opt.step()
    err = (model(ids) - ref(ids)).abs().max().item()
    if err > 1e-12:
        problems.append(f"outputs differ by {err} after 3 steps")
    narrow = torch.nn.Sequential(torch.nn.Linear(6, 1), torch.nn.ReLU(),
                                 torch.nn.Linear(1, 4)).double()
    try:
        narrow = shard_model(narrow, min_params=1)
        n = commlib.get_world_size()
        kinds = [type(m).__name__ for m in narrow]
        if n > 1 and kinds != ["Linear", "ReLU", "ColumnParallelLinear"] and n <= 4:
            problems.append(f"narrow layers sharded as {kinds}")
    except ValueError as e:
        problems.append(f"narrow Linear raised {e}")
    agree(not problems, problems)
