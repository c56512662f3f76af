"""Relaxed replicas and state dicts (issue 30), under ``mpiexec -n 2 python -m pytest
--with-mpi --only-mpi tests/test_relaxed_replicas.py``.

A state dict of a relaxed algorithm's module (``ddp.state_dict()``,
``ddp.module.state_dict()``) taken while the replicas differ holds one rank's replica: it
warns once per wrapper (``RelaxedReplicaWarning``, naming ``average_parameters()``) on
the rank that took it, and is no collective (rank 0 alone takes one here). Before the fix
nothing warned. Negative controls: the replicas measured apart when it warns; no warning
once they are averaged, for an algorithm that keeps them equal, before any training, or
under ``per_rank_state()``.
"""
import warnings

import pytest

torch = pytest.importorskip("torch")

import commlib  # noqa: E402
from commlib import ReduceOp  # noqa: E402
from commlib.ddp import RelaxedReplicaWarning, per_rank_state  # noqa: E402


def wrapper(algorithm="local_sgd", **kwargs):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                              torch.nn.Linear(8, 2)).double()
    if algorithm == "local_sgd":
        kwargs.setdefault("sync_every", 1000)
    return commlib.DistributedDataParallel(net, algorithm=algorithm, **kwargs)


def train(ddp, steps):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(10 + commlib.get_rank())  # each rank its own data
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(8, 4, generator=g, dtype=torch.float64)).square().mean().backward()
        opt.step()


def spread(ddp):
    """Largest difference between the ranks' replicas (measured on every rank)."""
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    hi, lo = flat.clone(), flat.clone()
    commlib.allreduce(hi, ReduceOp.MAX)
    commlib.allreduce(lo, ReduceOp.MIN)
    return (hi - lo).max().item()


def relaxed_warnings(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if issubclass(w.category, RelaxedReplicaWarning)]


@pytest.mark.mpi(min_size=2)
def test_state_dict_of_apart_replicas_warns_once_on_its_rank_without_a_collective():
    rank = commlib.get_rank()
    ddp = wrapper()
    train(ddp, 3)
    assert ddp.replicas_may_differ and spread(ddp) > 1e-3
    if rank == 0:  # one rank alone: not a collective
        first = relaxed_warnings(ddp.module.state_dict)
        assert len(first) == 1, first
        assert "rank 0" in first[0] and "average_parameters()" in first[0], first
        assert "3 iteration(s)" in first[0] and "'local_sgd'" in first[0], first
        assert relaxed_warnings(ddp.state_dict) == []  # once per wrapper
    else:
        found = relaxed_warnings(ddp.state_dict)  # the wrapper's (keys "module.*") too
        assert len(found) == 1 and f"rank {rank}" in found[0], found
    commlib.barrier()
    ddp.average_parameters()
    assert not ddp.replicas_may_differ and spread(ddp) == 0.0
    ddp.close()


@pytest.mark.mpi(min_size=2)
def test_no_warning_when_the_replicas_are_equal():
    fresh = wrapper()
    assert not fresh.replicas_may_differ  # nothing trained yet
    assert relaxed_warnings(fresh.module.state_dict) == []
    train(fresh, 2)
    fresh.average_parameters()
    assert relaxed_warnings(fresh.module.state_dict) == []
    train(fresh, 1)  # apart again: the warning was not spent above
    assert len(relaxed_warnings(fresh.module.state_dict)) == 1
    fresh.close()
    synchronous = wrapper("gradient_allreduce")
    train(synchronous, 2)
    assert not synchronous.replicas_may_differ and spread(synchronous) == 0.0
    assert relaxed_warnings(synchronous.module.state_dict) == []
    synchronous.close()


@pytest.mark.mpi(min_size=2)
def test_per_rank_state_takes_this_ranks_replica_on_purpose():
    ddp = wrapper()
    train(ddp, 2)
    with per_rank_state():
        assert relaxed_warnings(ddp.module.state_dict) == []
    assert len(relaxed_warnings(ddp.module.state_dict)) == 1  # outside it, it warns
    ddp.close()


@pytest.mark.mpi(min_size=2)
def test_sync_points_skip_replicas_the_script_averaged():
    """The runner's sync points and the frameworks' saves read the wrapper's own record:
    after the script's own average_parameters() they run no collective."""
    from commlib.run import sync
    ddp = wrapper()
    train(ddp, 2)
    ddp.average_parameters()
    before = commlib.stats()["allreduce"]["calls"]
    assert sync.average(ddp) is False
    assert commlib.stats()["allreduce"]["calls"] == before
    train(ddp, 1)
    assert sync.average(ddp) is True
    assert commlib.stats()["allreduce"]["calls"] > before and spread(ddp) == 0.0
    ddp.close()
