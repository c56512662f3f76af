"""ZeRO stage 1 (:class:`commlib.ZeroRedundancyOptimizer`) in elastic training: each rank's
optimizer shard is kept on the next rank as well, so that the shard of a dead rank is
rebuilt from its replica.

At each commit (:meth:`commlib.elastic.State.commit`, every step) rank ``r`` of ``N`` copies
its own shard's optimizer state (the local optimizer's ``state``: Adam's ``exp_avg``,
``exp_avg_sq`` and ``step`` of the ``floor(T / N)`` or ``ceil(T / N)`` elements it owns) and
sends it to rank ``r + 1 mod N``, receiving that of rank ``r - 1 mod N`` (point to point on
the optimizer's communicator): the replica's bytes per step are one shard state,
``(state tensors per element) x T / N x element size`` (Adam in float64: ``16 T / N``
bytes; SGD with momentum ``8 T / N``), against ZeRO's own allreduce (DDP) and all-gather of
``3 (N - 1) / N x 8 T`` bus bytes a step. The copy goes into the buffers of the commit that
falls out of ``keep`` (:mod:`commlib.elastic.commit_buffers`: one contiguous buffer, sent
as one message; nothing is allocated once ``keep`` commits were made); only the layouts
(a few hundred bytes) are exchanged at the commit, the replica itself travels
nonblocking while the next step's forward and backward run and is waited for before that
step's optimizer step (:class:`Ring`: what a death meanwhile means for the commit the
survivors agree on).

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
import pickle
from typing import Any

import numpy as np
import torch

from ..base.errors import CommError
from ..primitives import allgather, sendrecv
from ..sharded import flat_partition, zero_state
from ..sharded.zero import ZeroRedundancyOptimizer
from ..sharded.zero_checkpoint import _hyper
from . import transfer
from .commit_buffers import Flat, flat_for, layout_of

#: Tag of the replica exchange (on the optimizer's own communicator).
REPLICA_TAG = 35
#: Test hook: rebuild without the replicas (a dead rank's shard restarts with no state):
#: wrong on purpose, for the negative control of the tests.
_LOSE_REPLICA = False
#: Test hook: called in a commit after the layouts' exchange, before the replica is sent
#: (a test's victim dies there: its successor never receives that commit's replica).
_BEFORE_SEND: Any = None


def is_zero(optimizer: Any) -> bool:
    return isinstance(optimizer, ZeroRedundancyOptimizer)


def nbytes(tree: Any) -> int:
    """Bytes of the tensors of ``tree`` (a shard's state)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(nbytes(v) for v in tree.values())
    return 0


class Ring:
    """The replica exchange of the last commit, in flight (one per
    :class:`~commlib.elastic.State`): rank ``r`` sends its shard's state to ``r + 1`` and
    receives that of ``r - 1`` (nonblocking, from and into the commit's buffers), while
    the next step's forward and backward run; :meth:`wait` completes it before the
    optimizer's next step (a step pre-hook) and before the next commit.

    Why before the next step: the ranks' all-gather of that step then starts only once
    every rank holds its predecessor's replica, so a rank that recorded commit ``c + 1``
    knows every rank's exchange of commit ``c`` completed. A survivor whose receive of
    commit ``c`` had not completed at a death goes on from commit ``c - 1`` (its
    :meth:`~commlib.elastic.State._value`), which every survivor still holds (``keep``
    >= 2: none recorded ``c + 1``)."""

    def __init__(self) -> None:
        # (the commit, its sends and receive, the receive or None, its buffer, skeleton)
        self.pending: tuple[dict, list[Any], Any, Flat, Any] | None = None
        self.first = True  # no exchange completed over this group yet

    def wait(self) -> None:
        """Complete the exchange in flight (raises if a peer died meanwhile)."""
        if self.pending is not None:
            snap, works, _, left, skeleton = self.pending
            for w in works:
                w.wait()
            self.pending = None
            snap["left"] = transfer._join(skeleton, left.tensors)

    def received(self, snap: dict) -> bool:
        """Whether the replica of commit ``snap`` (of :func:`commit`) arrived (never
        blocks nor raises: a failed peer's receive counts as not arrived; a commit whose
        exchange is not the one in flight has it)."""
        if self.pending is None or self.pending[0] is not snap:
            return True
        snap, _, receive, left, skeleton = self.pending
        try:
            if receive is None or receive.is_completed():
                snap["left"] = transfer._join(skeleton, left.tensors)
                return True
        except Exception:  # noqa: BLE001 - the sender died
            pass
        return False

    def abandon(self) -> None:
        """Give up on the exchange in flight (its group failed): MPI keeps its buffers
        (:meth:`commlib.Work.abandon`), which no later commit reuses."""
        if self.pending is not None:
            for w in self.pending[1]:
                w.abandon()
        self.pending = None
        self.first = True


def commit(zero: ZeroRedundancyOptimizer, ring: Ring, reuse: dict | None = None) -> dict:
    """This rank's copy of its shard's state, sent to the next rank, and the replica of its
    predecessor's, received (point to point over the optimizer's group; the exchange
    completes in :meth:`Ring.wait`, right away for the first commit over a group).
    ``reuse``: a commit of :func:`commit` whose buffers are free (the one falling out)."""
    ring.wait()
    leaves: list[torch.Tensor] = []
    skeleton = transfer._split(zero.optim.state_dict()["state"], leaves)
    group, n, r = zero.process_group, zero.world_size, zero.rank
    if n > 1:  # the layouts first (the neighbours are in step: the all-gather just ended)
        succ, pred = (r + 1) % n, (r - 1) % n
        head = np.frombuffer(pickle.dumps(skeleton, pickle.HIGHEST_PROTOCOL), np.uint8)
        sizes = np.zeros(1, dtype=np.int64)
        sendrecv(np.array([head.size], np.int64), succ, sizes, pred, REPLICA_TAG, group)
        theirs = np.empty(int(sizes[0]), dtype=np.uint8)
        sendrecv(head, succ, theirs, pred, REPLICA_TAG, group)
    own = flat_for(layout_of(leaves), reuse and reuse.get("_own"))
    own.fill(leaves)
    snap = {"zero": True, "rank": r, "size": n, "members": tuple(group.ranks),
            "own": transfer._join(skeleton, own.tensors), "left": None,
            "hyper": [_hyper(g) for g in zero.param_groups], "_own": own}
    snap["replica_bytes"] = nbytes(snap["own"])
    if n > 1:
        left_skeleton = pickle.loads(theirs.tobytes())
        places: list[Any] = []
        transfer._collect(left_skeleton, places)
        places.sort(key=lambda p: p.index)
        left = flat_for(tuple((p.dtype, tuple(p.shape)) for p in places),
                        reuse and reuse.get("_left"))
        snap["_left"] = left
        if _BEFORE_SEND is not None:
            _BEFORE_SEND()
        works, receive = [], None
        if own.nbytes:
            works.append(group.send(own.data.numpy(), succ, REPLICA_TAG, async_op=True))
        if left.nbytes:
            receive = group.recv(left.data.numpy(), pred, REPLICA_TAG, async_op=True)
            works.append(receive)
        ring.pending = (snap, works, receive, left, left_skeleton)
        if ring.first:
            ring.wait()
    ring.first = False
    return snap


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
    if size > 1 and not _LOSE_REPLICA and saved["left"] is not None:  # (None: not arrived)
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
