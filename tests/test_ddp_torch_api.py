"""torch DDP's interface on commlib's wrapper, with torch DDP over gloo as the oracle in the
same job: constructor arguments (same order, same errors, each accepted one working),
uneven inputs under ``join()``, and communication hooks."""
import contextlib
import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import commlib  # noqa: E402
from torch_gloo import gloo_world  # noqa: E402

TOL = dict(rtol=1e-10, atol=1e-10)
TorchDDP = torch.nn.parallel.DistributedDataParallel


def net(seed=5):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(),
                         nn.Linear(12, 3)).double()


def batch(step, rank=None, per_rank=3):
    n = commlib.get_world_size()
    rank = commlib.get_rank() if rank is None else rank
    g = torch.Generator().manual_seed(1000 * step + 17)
    x = torch.randn(n * per_rank, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n * per_rank,), generator=g)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[mine], y[mine]


def raised(fn):
    """The exception ``fn()`` raised (``None`` if none)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - returned for comparison
        return exc
    return None


def train(model, steps=3, opt_cls=torch.optim.SGD):
    opt = opt_cls(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in (model.module if hasattr(model, "module")
                                         else model).parameters()]


@pytest.fixture(scope="module")
def gloo():
    return gloo_world()


def test_constructor_takes_torchs_arguments_in_torchs_order():
    ours = list(inspect.signature(commlib.DistributedDataParallel.__init__).parameters)
    theirs = list(inspect.signature(TorchDDP.__init__).parameters)
    assert ours[:len(theirs)] == theirs
    assert inspect.signature(commlib.DistributedDataParallel.__init__).parameters[
        "algorithm"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.mpi
@pytest.mark.parametrize("args,kwargs", [
    (([0],), {}),                                   # DDP(model, [0]) on a CPU module
    ((), {"device_ids": [0, 1]}),
    ((), {"output_device": 1}),
    ((), {"delay_all_reduce_named_params": []}),    # without param_to_hook_all_reduce
])
def test_bad_arguments_raise_what_torch_raises(gloo, args, kwargs):
    theirs = raised(lambda: TorchDDP(net(), *args, **kwargs))
    ours = raised(lambda: commlib.DistributedDataParallel(net(), *args, **kwargs))
    assert theirs is not None and ours is not None
    assert type(ours) is type(theirs), (ours, theirs)
    head = str(theirs).split(",")[0][:40]
    assert head in str(ours), (str(ours), str(theirs))


@pytest.mark.mpi
def test_a_module_without_trainable_parameters_raises_like_torch(gloo):
    def frozen():
        m = net()
        m.requires_grad_(False)
        return m
    theirs = raised(lambda: TorchDDP(frozen()))
    ours = raised(lambda: commlib.DistributedDataParallel(frozen()))
    assert type(ours) is type(theirs) is RuntimeError
    assert "doesn't have any parameter that requires a gradient" in str(ours)


@pytest.mark.mpi
def test_unknown_keyword_names_itself_and_the_algorithm():
    with pytest.raises(TypeError, match=r"\['bucket_size'\].*algorithm 'gradient_allreduce'"
                                        r".*average.*hierarchical"):
        commlib.DistributedDataParallel(net(), bucket_size=3)
    with pytest.raises(TypeError, match=r"bucket_cap_mb must be a number"):
        commlib.DistributedDataParallel(net(), bucket_cap_mb="25")
    with pytest.raises(ValueError, match=r"bucket_cap_mb must be positive"):
        commlib.DistributedDataParallel(net(), bucket_cap_mb=0)
    with pytest.raises(ValueError, match=r"mixed_precision"):
        commlib.DistributedDataParallel(net(), mixed_precision=object())


@pytest.mark.mpi
@pytest.mark.parametrize("kwargs", [
    {},
    {"device_ids": None, "output_device": None, "bucket_cap_mb": None},
    {"device_ids": [], "dim": 0, "check_reduction": True},
    {"gradient_as_bucket_view": True, "static_graph": True},
    {"broadcast_buffers": False, "skip_all_reduce_unused_params": True},
    {"forward_sync_buffers": False, "batched_grad_copy": True, "init_sync": True},
    {"bucket_cap_mb_list": [0.0005, 0.001]},
    {"process_group": "torch-world"},
    {"process_group": "commlib-world"},
])
def test_accepted_arguments_train_like_torch(gloo, kwargs):
    kwargs = dict(kwargs)
    if kwargs.get("process_group") == "torch-world":
        kwargs["process_group"] = dist.group.WORLD
    elif kwargs.get("process_group") == "commlib-world":
        kwargs["process_group"] = commlib.world()
    with warnings_ignored():
        theirs = train(TorchDDP(net(), bucket_cap_mb=0.001))
        ddp = commlib.DistributedDataParallel(net(), **kwargs)
    try:
        ours = train(ddp)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, **TOL)
        if "bucket_cap_mb_list" in kwargs:
            assert len(ddp._ctx.buckets) >= 3
    finally:
        ddp.close()


def warnings_ignored():
    import warnings
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


@pytest.mark.mpi
def test_init_sync_false_leaves_ranks_different_and_torch_agrees(gloo):
    def model():
        return net(seed=commlib.get_rank())
    theirs = TorchDDP(model(), init_sync=False)
    ddp = commlib.DistributedDataParallel(model(), init_sync=False)
    try:
        for a, b in zip(ddp.module.parameters(), theirs.module.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    finally:
        ddp.close()


@pytest.mark.mpi
def test_parameters_to_ignore_are_neither_broadcast_nor_exchanged(gloo):
    def model():
        m = net(seed=commlib.get_rank())
        m._ddp_params_and_buffers_to_ignore = ["0.bias"]
        return m
    theirs = TorchDDP(model())
    ddp = commlib.DistributedDataParallel(model())
    try:
        x, y = batch(0)
        F.cross_entropy(theirs(x), y).backward()
        F.cross_entropy(ddp(x), y).backward()
        for (name, a), b in zip(ddp.module.named_parameters(), theirs.module.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
            if b.grad is None:
                assert a.grad is None, name
            else:
                torch.testing.assert_close(a.grad, b.grad, **TOL)
    finally:
        ddp.close()


# -- uneven inputs ------------------------------------------------------------------------

def uneven_run(model, n_batches, join_kwargs, ddp_join):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with ddp_join(model, **join_kwargs):
        for step in range(n_batches):
            x, y = batch(step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return [p.detach().clone() for p in model.module.parameters()]


@pytest.mark.mpi
@pytest.mark.parametrize("join_kwargs", [{}, {"divide_by_initial_world_size": False}])
@pytest.mark.parametrize("find_unused", [False, True])
def test_join_matches_torch_with_uneven_inputs(gloo, join_kwargs, find_unused):
    n_batches = 2 + 2 * commlib.get_rank()  # rank r runs out after 2 + 2r iterations
    theirs = uneven_run(TorchDDP(net(), find_unused_parameters=find_unused), n_batches,
                        join_kwargs, lambda m, **kw: m.join(**kw))
    ddp = commlib.DistributedDataParallel(net(), bucket_cap_mb=0.0005,
                                          find_unused_parameters=find_unused)
    try:
        ours = uneven_run(ddp, n_batches, join_kwargs, lambda m, **kw: m.join(**kw))
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, **TOL)
        assert ddp._ctx.step == 2 + 2 * (commlib.get_world_size() - 1)
    finally:
        ddp.close()


@pytest.mark.mpi
def test_join_negative_control_without_join_the_model_differs(gloo):
    """Without shadowing, a rank that stops early leaves the others' gradients averaged
    over fewer contributions: the comparison above must be able to see a difference."""
    if commlib.get_world_size() == 1:
        pytest.skip("needs uneven ranks")
    theirs = uneven_run(TorchDDP(net()), 2 + 2 * commlib.get_rank(), {},
                        lambda m, **kw: m.join(**kw))
    steps = 2 + 2 * (commlib.get_world_size() - 1)  # every rank runs all iterations
    mine = uneven_run(commlib.DistributedDataParallel(net()), steps, {},
                      lambda m, **kw: contextlib.nullcontext())
    assert any(not torch.allclose(a, b, **TOL) for a, b in zip(mine, theirs))


@pytest.mark.mpi(min_size=2)
def test_join_throw_on_early_termination_raises_on_every_rank():
    ddp = commlib.DistributedDataParallel(net())
    try:
        with pytest.raises(RuntimeError, match="exhausted inputs"):
            uneven_run(ddp, 1 + commlib.get_rank(), {"throw_on_early_termination": True},
                       lambda m, **kw: m.join(**kw))
    finally:
        ddp.close()


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm,kwargs", [("local_sgd", {"sync_every": 2}),
                                              ("bytegrad", {}),
                                              ("decentralized", {})])
def test_join_with_other_algorithms_finishes_with_equal_replicas(algorithm, kwargs):
    ddp = commlib.DistributedDataParallel(net(), bucket_cap_mb=0.0005, algorithm=algorithm,
                                          **kwargs)
    try:
        uneven_run(ddp, 2 + commlib.get_rank(), {}, lambda m, **kw: m.join(**kw))
        mine = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()]).numpy()
        assert all(np.array_equal(o, mine) for o in commlib.allgather(mine))
    finally:
        ddp.close()


# -- communication hooks ------------------------------------------------------------------

def noop_hook(state, bucket):
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


@pytest.mark.mpi
@pytest.mark.parametrize("hook_name", ["torch_allreduce", "commlib_allreduce", "torch_fp16",
                                       "commlib_fp16", "noop"])
def test_comm_hooks_against_torch_default(gloo, hook_name):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from commlib.ddp import comm_hooks
    hook = {"torch_allreduce": default_hooks.allreduce_hook,
            "commlib_allreduce": comm_hooks.allreduce_hook,
            "torch_fp16": default_hooks.fp16_compress_hook,
            "commlib_fp16": comm_hooks.fp16_compress_hook,
            "noop": noop_hook}[hook_name]
    theirs = train(TorchDDP(net(), bucket_cap_mb=0.0005))
    ddp = commlib.DistributedDataParallel(net(), bucket_cap_mb=0.0005)
    try:
        ddp.register_comm_hook(None, hook)
        ours = train(ddp)
    finally:
        ddp.close()
    tol = dict(rtol=1e-3, atol=1e-3) if "fp16" in hook_name else TOL
    close = all(torch.allclose(a, b, **tol) for a, b in zip(ours, theirs))
    if hook_name == "noop" and commlib.get_world_size() > 1:
        assert not close  # negative control: a hook that does not communicate is caught
    else:
        assert close


@pytest.mark.mpi
def test_comm_hook_rules_follow_torch():
    ddp = commlib.DistributedDataParallel(net())
    try:
        ddp.register_comm_hook(None, noop_hook)
        with pytest.raises(RuntimeError, match="can only be called once"):
            ddp.register_comm_hook(None, noop_hook)
    finally:
        ddp.close()
    ddp = commlib.DistributedDataParallel(net())
    try:
        train(ddp, steps=1)
        with pytest.raises(RuntimeError, match="before the first backward"):
            ddp.register_comm_hook(None, noop_hook)
        with pytest.raises(TypeError, match="callable"):
            commlib.DistributedDataParallel.register_comm_hook(ddp, None, 3)
    finally:
        ddp.close()


@pytest.mark.mpi
def test_torch_generic_join_context_works_with_the_wrapper(gloo):
    from torch.distributed.algorithms.join import Join as TorchJoin
    n_batches = 2 + 2 * commlib.get_rank()
    theirs = uneven_run(TorchDDP(net()), n_batches, {}, lambda m, **kw: m.join(**kw))
    ddp = commlib.DistributedDataParallel(net(), bucket_cap_mb=0.0005)
    try:
        ours = uneven_run(ddp, n_batches, {}, lambda m, **kw: TorchJoin([m]))
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, **TOL)
    finally:
        ddp.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", ["gloo", "commlib"])
def test_process_group_may_be_a_torch_sub_group(gloo, backend):
    """A torch group of a subset of ranks (any backend) becomes the wrapper's group: only
    its members construct the wrapper, and their gradients average over the members."""
    n = commlib.get_world_size()
    ranks = [n - 1, 0]
    pg = dist.new_group(ranks, backend=backend)
    if commlib.get_rank() not in ranks:
        return
    ref = net()
    ddp = commlib.DistributedDataParallel(net(), process_group=pg)
    try:
        assert ddp.process_group.size == 2
        x, y = batch(0, rank=commlib.get_rank())
        F.cross_entropy(ddp(x), y).backward()
        xs = [batch(0, rank=r) for r in ranks]
        loss = sum(F.cross_entropy(ref(a), b) for a, b in xs) / 2
        loss.backward()
        for a, b in zip(ddp.module.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, **TOL)
    finally:
        ddp.close()
