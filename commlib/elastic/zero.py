"""ZeRO stage 1 (:class:`commlib.ZeroRedundancyOptimizer`) in elastic training: each rank's
optimizer shard is kept on the next rank as well, so that the shard of a dead rank is
rebuilt from its replica.

At each commit (:meth:`commlib.elastic.State.commit`, every step) rank ``r`` of ``N`` copies
its own shard's optimizer state (the local optimizer's ``state``: Adam's ``exp_avg``,
``exp_avg_sq`` and ``step`` of the ``floor(T / N)`` or ``ceil(T / N)`` elements it owns) and
sends it to rank ``r + 1 mod N``, receiving that of rank ``r - 1 mod N`` (point to point on
the optimizer's communicator; the commit is recorded once both arrived): the replica's
bytes per step are one shard state, ``(state tensors per element) x T / N x element size``
(Adam in float64: ``16 T / N`` bytes; SGD with momentum ``8 T / N``), against ZeRO's own
allreduce (DDP) and all-gather of ``3 (N - 1) / N x 8 T`` bus bytes a step.

After a death the survivors agree on a commit (each restores its own copy, as for the
other per-rank states: :class:`~commlib.elastic.State`), then rebuild the full optimizer
state of that commit: every survivor contributes its own shard and the replica it holds
(one allgather over the survivors), the dead rank's shard comes from the replica on its
successor, and the parameters are partitioned again over the survivors
(:meth:`commlib.ZeroRedundancyOptimizer.regroup`), each taking the state of the elements
it owns now. The state travels whole to every survivor at that moment (a full copy of
the optimizer state for the time of the rebuild). Two adjacent ranks (``r`` and its
successor) dying together lose shard ``r``: the survivors raise
:class:`~commlib.CommError` naming it. Spares and replacements (``run(spares=...)``,
``replace=True``) are not supported with ZeRO (refused by :func:`commlib.elastic.run`):
a newcomer would need a shard of its own cut out of the others'.
"""
from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch

from ..base.errors import CommError
from ..primitives import allgather
from ..sharded import flat_partition, zero_state
from ..sharded.zero import ZeroRedundancyOptimizer
from ..sharded.zero_checkpoint import _hyper
from . import transfer

#: Tag of the replica exchange (on the optimizer's own communicator).
REPLICA_TAG = 35
#: Test hook: rebuild without the replicas (a dead rank's shard restarts with no state):
#: wrong on purpose, for the negative control of the tests.
_LOSE_REPLICA = False


def is_zero(optimizer: Any) -> bool:
    return isinstance(optimizer, ZeroRedundancyOptimizer)


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    return tree


def nbytes(tree: Any) -> int:
    """Bytes of the tensors of ``tree`` (a shard's state)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(nbytes(v) for v in tree.values())
    return 0


def commit(zero: ZeroRedundancyOptimizer) -> dict:
    """This rank's copy of its shard's state and the replica of its predecessor's
    (collective over the optimizer's group: the shard goes to the successor)."""
    own = _clone(zero.optim.state_dict()["state"])
    group, n, r = zero.process_group, zero.world_size, zero.rank
    left: dict = {}
    if n > 1:
        # ring exchange with blocking sends: even ranks send first, odd ranks receive
        # first (rank 1 receives first, so the chain of waits always ends)
        if r % 2 == 0:
            transfer.send(group, (r + 1) % n, own, REPLICA_TAG)
            left = transfer.recv(group, (r - 1) % n, REPLICA_TAG)
        else:
            left = transfer.recv(group, (r - 1) % n, REPLICA_TAG)
            transfer.send(group, (r + 1) % n, own, REPLICA_TAG)
    return {"zero": True, "rank": r, "size": n, "members": tuple(group.ranks), "own": own,
            "left": left, "hyper": [_hyper(g) for g in zero.param_groups],
            "replica_bytes": nbytes(own)}


def _allgather_objects(value: Any, group: Any) -> list[Any]:
    stream = io.BytesIO()
    torch.save(value, stream)
    mine = np.frombuffer(stream.getvalue(), dtype=np.uint8)
    lengths = allgather(np.array([mine.size], dtype=np.int64), group)
    padded = np.zeros(int(lengths.max()), dtype=np.uint8)
    padded[:mine.size] = mine
    rows = allgather(padded, group)
    return [torch.load(io.BytesIO(rows[i][:int(lengths[i, 0])].tobytes()),
                       weights_only=False) for i in range(group.size)]


def rebuild(zero: ZeroRedundancyOptimizer, group: Any, saved: dict) -> dict:
    """Collective over ``group`` (the survivors, each holding ``saved``: its commit of the
    agreed step, of :func:`commit`): the full optimizer state of that commit from the
    survivors' shards and replicas, the optimizer partitioned over ``group`` with it;
    returns the commit of the new partition (cut from the full state, no exchange)."""
    size, mine = saved["size"], {saved["rank"]: saved["own"]}
    if size > 1 and not _LOSE_REPLICA:
        mine.setdefault((saved["rank"] - 1) % size, saved["left"])
    every = _allgather_objects((saved["members"], mine), group)
    members = {m for m, _ in every}
    if len(members) > 1:
        raise CommError(f"commlib.elastic (rank {group.rank}): the survivors' ZeRO commits "
                        f"were taken over different groups {sorted(members)} (a death "
                        f"during the rebuild of the optimizer state)")
    have: dict[int, dict] = {}
    for _, shards in every:
        for r, st in shards.items():
            have.setdefault(r, st)
    lost = [r for r in range(size) if r not in have]
    if lost and not _LOSE_REPLICA:
        raise CommError(f"commlib.elastic (rank {group.rank}): the ZeRO optimizer shards of "
                        f"rank(s) {lost} of {size} are lost: each rank's shard is kept on "
                        f"the next rank only, and both died")
    groups = [list(g["params"]) for g in zero.param_groups]
    for g, hyper in zip(zero.param_groups, saved["hyper"]):
        g.update(hyper)
    kinds = flat_partition.plan(groups, size, zero._bucket_bytes)
    full = zero_state.full_state(kinds, groups, [have.get(r, {}) for r in range(size)])
    zero.regroup(group, full)
    n, r = zero.world_size, zero.rank
    own = zero_state.local_state(zero._kinds, groups, r, full)
    left = zero_state.local_state(zero._kinds, groups, (r - 1) % n, full) if n > 1 else {}
    return {"zero": True, "rank": r, "size": n, "members": tuple(zero.process_group.ranks),
            "own": own, "left": left, "hyper": saved["hyper"], "replica_bytes": nbytes(own)}
