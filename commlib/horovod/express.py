"""The express lane of :class:`commlib.horovod.controller.Controller`: a blocking tiny
allreduce (CPU, one tensor of at most 128 bytes, float32/64 or integers, not Adasum: see
:mod:`commlib.horovod.wire` and :func:`commlib.horovod.ops.express_entry`) done in one
negotiation round driven on the caller's thread, when its rank has nothing else
outstanding. The round's slot is the one the general round would send, so a rank that is
not on the lane (joined, other pending names, a different name, shape, dtype or op) sees
an ordinary announcement, and the lane falls back to the general processing when the
gathered slots are not all equal to its own (a disagreement still raises on every rank).
Automatic names are never cached; the reduction runs in rank order, as
:func:`commlib.horovod.execute.inline_allreduce` does.
"""
from __future__ import annotations

import struct
import time
from typing import Any

import numpy as np
from torch import from_numpy as torch_from_numpy

from ..primitives import allgather
from . import wire
from .execute import _NP_COMBINE, _np_scale, post_factor
from .requests import Request

SLOT_BYTES = 512
_LENGTH = struct.Struct("<I")
_CID = struct.Struct("<I")


class ExpressLane:
    """Mixin of :class:`~commlib.horovod.controller.Controller` (its state: the slot and
    row buffers, the driving lock, the tables and the response cache)."""

    def express(self, tensor: Any, name: Any, ent: tuple, out: Any) -> Any:
        """A blocking tiny allreduce (``ent``: its memoized metadata, see
        :func:`commlib.horovod.ops.express_entry`) in one round driven right here, when
        this rank has nothing else outstanding; ``NotImplemented`` (nothing done, no name
        taken) when it has. The round is the general one - the same slot bytes as
        :meth:`_round` would send - so ranks in a general round (joined, other pending
        names, a different name, shape, dtype or op) see an ordinary announcement, and
        this rank falls back to the general processing when the gathered slots are not
        all equal to its own: a disagreement raises on every rank as ever.
        ``out``: the tensor to write the result into (in place), or None for a new one."""
        if not self._driving.acquire(False):
            return NotImplemented
        try:
            if (self.unannounced or self.pending or self.table or self.joined
                    or self.stopping or self.closed or self.join_req is not None):
                return NotImplemented
            meta, nbytes, npdt, mb, shape = ent
            if name is None:
                kind = "allreduce"
                k = self.counters.get(kind, 0)
                self.counters[kind] = k + 1
                name = f"allreduce.noname.{k}"
                cid = None   # automatic names are never cached
            else:
                if name.__class__ is not str:
                    name = str(name)
                cid = self.my_cache.get((name, meta))
            data = (tensor.detach() if tensor.requires_grad else tensor).numpy().tobytes()
            if cid is None:
                ann = wire.announcement(name, mb)
                body = b"".join((wire.HEADER.pack(0, 0, len(ann)), ann, data))
            else:
                body = b"".join((wire.HEADER.pack(0, 1, 0), _CID.pack(cid), data))
            n = len(body)
            slot = self._slot_view
            _LENGTH.pack_into(slot, 0, n)
            slot[4:4 + n] = body
            work = allgather(self._slot, group=self.neg, async_op=True, out=self._rows)
            rows = self._rows
            if not work.is_completed():
                work.wait()
            self.rounds += 1
            size, o = self.size, 4 + n - nbytes
            rb = rows.tobytes()
            head = rb[self.rank * SLOT_BYTES:self.rank * SLOT_BYTES + o]
            common = True
            for r in range(size):
                if rb[r * SLOT_BYTES:r * SLOT_BYTES + o] != head:
                    common = False
                    break
            if common:
                if cid is None:
                    self._cache_id(name, [meta] * size, None, meta)
                x = rows[:, o:o + nbytes].view(npdt)
                _, op, pre, post, _ = meta
                if pre != 1.0:
                    x = x.copy()
                    _np_scale(x, pre)
                if op <= 1 and size > 1:   # Average, Sum: rank order, as inline_allreduce
                    acc = x[0] + x[1]
                    for r in range(2, size):
                        acc += x[r]
                else:
                    acc = x[0].copy()
                    combine = _NP_COMBINE[op]
                    for r in range(1, size):
                        combine(acc, x[r], out=acc)
                post = post_factor(op, post, size)
                if post != 1.0:
                    _np_scale(acc, post)
                if out is None:
                    return torch_from_numpy(acc if shape is None else acc.reshape(shape))
                out.detach().view(-1).copy_(torch_from_numpy(acc))
                return out
            # not the common round: an ordinary one from here on (this rank's request
            # counts as announced in it)
            req = Request("allreduce", name, meta, [tensor], [out], {"grouped": False})
            req.controller = self
            with self.mutex:
                self.pending[name] = req
            lengths = rows.view(np.uint32)[:, 0].tolist()
            self._digest([rb[r * SLOT_BYTES + 4:r * SLOT_BYTES + 4 + k]
                          for r, k in enumerate(lengths)])
            while not req.done and not self.closed:
                if not self._round(spin=True):
                    time.sleep(5e-5)
        finally:
            self._driving.release()
        if not req.done:
            self.wait(req)
        if req.error is not None:
            raise req.error
        return req.result
