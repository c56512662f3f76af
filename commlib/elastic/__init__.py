"""Elastic training: survive the death of ranks, go on with the survivors, let a
replacement join (issue 21).

Fault-tolerant mode (``commlib.init(fault_tolerant=True)`` or ``COMMLIB_FAULT_TOLERANT=1``;
see :mod:`commlib.fault.fault_tolerance` for the launch it needs) makes a dead peer a
:class:`~commlib.PeerFailure` on every survivor; this package turns that into training that
goes on, with an API a Horovod-elastic user recognizes::

    # run: COMMLIB_FAULT_TOLERANT=1 mpiexec -disable-auto-cleanup -n 2
    import torch
    import commlib

    commlib.init(fault_tolerant=True)
    torch.manual_seed(0)
    x, y = torch.randn(960, 8), torch.randn(960, 1)          # the dataset, on every rank
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = commlib.elastic.ElasticSampler(len(x), batch_size=96)
    state = commlib.elastic.State(model, optimizer, sampler, epoch=0)
    total_steps = 20

    @commlib.elastic.run
    def train(state):
        ddp = state.wrap(algorithm="gradient_allreduce")   # over the current group
        while state.step < total_steps:
            idx = sampler.indices(state.step, state.group.rank, state.group.size)
            loss = torch.nn.functional.mse_loss(ddp(x[idx]), y[idx])
            loss.backward(); optimizer.step(); optimizer.zero_grad()
            state.commit()                              # the step is done on every rank

    train(state)
    print(commlib.get_rank(), state.step, float(model.weight.sum()))

:class:`State` holds the model, optimizer, sampler and user values and commits them in
memory; :func:`run` catches the failure, shrinks the group, restores the agreed commit on
every survivor and calls the training function again over the survivors.
"""
from ..base.errors import PeerFailure
from .run import recover, run
from .sampler import ElasticSampler
from .state import POLICIES, UNSUPPORTED, State

__all__ = ["ElasticSampler", "PeerFailure", "POLICIES", "State", "UNSUPPORTED", "recover",
           "run"]
