"""``monitored_barrier`` for the commlib backend: a barrier that names the ranks that did
not arrive.

torch's ``dist.monitored_barrier`` refuses every backend but gloo (the check is in torch's
Python function, before the backend is asked). :func:`monitored_barrier` is the same
for commlib process groups, with gloo's semantics and message shapes: every rank but 0
sends rank 0 a token and waits for its acknowledgement; rank 0 waits for every token
until ``timeout`` (all at once: the whole barrier takes at most ``timeout``), then
acknowledges. When a rank is missing, rank 0 raises ``DistBackendError``
``[Rank 0]: Rank 2 failed to pass monitoredBarrier in 1000 ms`` (the lowest missing
rank), or with ``wait_all_ranks=True`` ``[Rank 0]: Ranks 1, 2 failed to pass
monitoredBarrier in 1000 ms`` (every missing rank); the ranks that arrived then raise
``Rank 1 successfully reached monitoredBarrier, but received errors while waiting for
send/recv from rank 0...`` once the timeout passes without the acknowledgement. Messages
travel on two reserved tags (:data:`TAGS`) of the group's communicator; receives that
nothing matched are cancelled, so the group stays usable.
"""
from __future__ import annotations

from time import monotonic

import numpy as np
import torch.distributed as dist

from .. import primitives as P
from .deadlines import abandon, poll

#: (token, acknowledgement) tags; user tags must stay below these.
TAGS = (1 << 28, (1 << 28) + 1)


def run(group: P.Group, rank: int, timeout_s: float, wait_all_ranks: bool) -> None:
    """The barrier on ``group`` (see :func:`monitored_barrier`)."""
    n = group.size
    if n == 1:
        return
    deadline = monotonic() + timeout_s
    ms = int(round(timeout_s * 1000))
    token_tag, ack_tag = TAGS
    if rank != 0:
        sent = P.send(np.ones(1, np.uint8), 0, token_tag, group, async_op=True)
        ack = P.recv(np.zeros(1, np.uint8), 0, ack_tag, group, async_op=True)
        if not (poll(sent, deadline) and poll(ack, deadline)):
            ack.cancel(0.1)
            raise dist.DistBackendError(
                f"Rank {rank} successfully reached monitoredBarrier, but received errors "
                f"while waiting for send/recv from rank 0 within {ms} ms. Please check rank "
                f"0 logs for faulty rank.")
        return
    tokens = {r: P.recv(np.zeros(1, np.uint8), r, token_tag, group, async_op=True)
              for r in range(1, n)}
    missing = []
    for r, work in tokens.items():
        if poll(work, deadline):
            continue
        missing.append(r)
        if not wait_all_ranks:
            break
    if missing:
        for work in tokens.values():
            work.cancel(0.1)
        if not wait_all_ranks:
            raise dist.DistBackendError(f"[Rank 0]: Rank {missing[0]} failed to pass "
                                        f"monitoredBarrier in {ms} ms")
        raise dist.DistBackendError(f"[Rank 0]: Ranks {', '.join(map(str, missing))} failed "
                                    f"to pass monitoredBarrier in {ms} ms")
    acks = [P.send(np.ones(1, np.uint8), r, ack_tag, group, async_op=True)
            for r in range(1, n)]
    for r, work in zip(range(1, n), acks):
        if not poll(work, deadline):
            abandon(*acks)
            raise dist.DistBackendError(f"[Rank 0]: Rank {r} failed to pass "
                                        f"monitoredBarrier in {ms} ms (no acknowledgement "
                                        f"received)")

