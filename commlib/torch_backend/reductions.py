"""The reducing collectives of :class:`.process_group.ProcessGroupCommlib` (a mixin):
``all_reduce`` (dense and sparse), ``all_reduce_coalesced``, ``reduce``, ``reduce_scatter``
and ``reduce_scatter_tensor``. ``ReduceOp.AVG`` on integer tensors has NCCL's semantics
(:func:`.convert.integer_average`); sparse tensors go to :mod:`.sparse`; the in-place
``reduce_scatter_tensor`` (the output is this rank's block of the input) reduces into a
separate buffer, then copies."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import primitives as P
from ..base.reduce_ops import ReduceOp
from . import profiling, sparse
from .convert import (
    as_list,
    check_count,
    check_list,
    dense,
    divide_truncating,
    flatten,
    integer_average,
    one,
    overlaps,
    reduce_op,
    unflatten,
)
from .work import done

_SUM = ReduceOp.SUM
_AVG = ReduceOp.AVG
_STRIDED = torch.strided


class Reductions:
    """Needs ``group``, ``_rank``, ``_deadlines``, ``size()``, ``_launch`` and
    ``_blocking`` (see :class:`.process_group.ProcessGroupCommlib`)."""

    def allreduce(self, tensors: list, opts: Any = None) -> Any:
        """In place on every rank: ``all_reduce``; sparse COO tensors too (:mod:`.sparse`).
        ``ReduceOp.AVG`` on integer tensors: the sum divided by the group size, rounded
        toward zero (NCCL's semantics, see :func:`.convert.integer_average`)."""
        opts = opts or dist.AllreduceOptions()
        op = reduce_op(opts, "all_reduce", self._rank)
        tensors = as_list(tensors)
        if len(tensors) == 1:
            t = tensors[0]
            if t.layout is _STRIDED and (op is not _AVG or t.dtype.is_floating_point):
                # the common case (one dense tensor, no integer average): no closures
                # beyond the call itself, no copy of the tensor object unless it needs one
                if t.requires_grad:
                    t = t.detach()
                group = self.group
                return self._launch("all_reduce", opts,
                                    lambda a: P.allreduce(t, op, group, a), tensors)
        if tensors and tensors[0].is_sparse:
            return self._sparse_allreduce(tensors, op)
        dense(tensors, "all_reduce", self._rank)
        if len(tensors) == 1:
            t = tensors[0].detach()
            average, n = integer_average(op, t, "all_reduce", self._rank), self._size

            def after(_: Any) -> None:
                divide_truncating(t, n)
            return self._launch("all_reduce", opts,
                                lambda a: P.allreduce(t, _SUM if average else op, self.group,
                                                      a), tensors, after if average else None)
        for t in tensors:
            self._allreduce_one(t.detach(), op, "all_reduce")
        return done(tensors)

    def _allreduce_one(self, t: torch.Tensor, op: Any, name: str) -> None:
        average = integer_average(op, t, name, self._rank)
        self._blocking(name, lambda a: P.allreduce(t, _SUM if average else op, self.group, a))
        if average:
            divide_truncating(t, self.size())

    def _sparse_allreduce(self, tensors: list, op: Any) -> Any:
        event = profiling.start("sparse_all_reduce", tensors, self)
        try:
            for t in tensors:
                self._deadlines.check("all_reduce")
                sparse.all_reduce(t, op, self.group, self._complete, self._rank)
        finally:
            profiling.end(event)
        return done(tensors)

    def _complete(self, work: Any, op: str = "all_reduce") -> Any:
        """Complete one started commlib operation within the group's timeout."""
        return self._deadlines.wait(work, op, self._deadlines.deadline())

    def allreduce_coalesced(self, tensors: list, opts: Any = None) -> Any:
        """All tensors in one exchange per dtype and device (flattened, then copied back)."""
        opts = opts or dist.AllreduceCoalescedOptions()
        op = reduce_op(opts, "all_reduce_coalesced", self._rank)
        dense(tensors, "all_reduce_coalesced", self._rank)
        kinds: dict[tuple, list] = {}
        for t in tensors:
            kinds.setdefault((t.dtype, t.device), []).append(t)
        if len(kinds) == 1:
            flat = flatten(tensors)
            average = integer_average(op, flat, "all_reduce_coalesced", self._rank)

            def after(_: Any) -> None:
                if average:
                    divide_truncating(flat, self.size())
                unflatten(flat, tensors)
            return self._launch("all_reduce", opts,
                                lambda a: P.allreduce(flat, _SUM if average else op,
                                                      self.group, a), tensors, after)
        event = profiling.start("all_reduce", tensors, self)
        try:
            for same in kinds.values():
                flat = flatten(same)
                self._allreduce_one(flat, op, "all_reduce_coalesced")
                unflatten(flat, same)
        finally:
            profiling.end(event)
        return done(tensors)

    def reduce(self, tensors: list, opts: Any = None) -> Any:
        """Result in place on ``opts.rootRank``; other ranks' tensors unchanged."""
        opts = opts or dist.ReduceOptions()
        op = reduce_op(opts, "reduce", self._rank)
        t = one(tensors, "reduce", self._rank).detach()
        dense([t], "reduce", self._rank)
        root = opts.rootRank
        average = integer_average(op, t, "reduce", self._rank)

        def after(_: Any) -> None:
            if average and self._rank == root:
                divide_truncating(t, self.size())
        return self._launch("reduce", opts,
                            lambda a: P.reduce(t, root, _SUM if average else op, self.group,
                                               a), list(tensors), after)

    def reduce_scatter(self, outputs: list, input_lists: list, opts: Any = None) -> Any:
        """``outputs[0]`` = reduction over ranks of ``input_lists[0][rank]``."""
        opts = opts or dist.ReduceScatterOptions()
        op = reduce_op(opts, "reduce_scatter", self._rank)
        out = one(outputs, "reduce_scatter", self._rank)
        inputs = check_list(input_lists[0], self.size(), "input_list", "reduce_scatter",
                            self._rank)
        dense([out] + inputs, "reduce_scatter", self._rank)
        for t in inputs:
            check_count(t, out.numel(), "every input", "reduce_scatter", self._rank)
        flat = flatten(inputs)
        return self._reduce_scatter(opts, op, flat, out, inputs)

    def _reduce_scatter(self, opts: Any, op: Any, inp: torch.Tensor, output: torch.Tensor,
                        inputs: list) -> Any:
        """``output`` = block ``rank`` of the reduction of ``inp``; into a separate buffer
        when ``output`` overlaps ``inp`` (the in-place form)."""
        into = output.detach()
        separate = overlaps(into, inp) or not into.is_contiguous()
        if separate:
            into = torch.empty(into.shape, dtype=into.dtype, device=into.device)
        average = integer_average(op, into, "reduce_scatter", self._rank)

        def after(_: Any) -> None:
            if average:
                divide_truncating(into, self.size())
            if separate:
                with torch.no_grad():
                    output.detach().copy_(into)
        return self._launch("reduce_scatter", opts,
                            lambda a: P.reduce_scatter(inp, _SUM if average else op,
                                                       self.group, a, into),
                            [output], after, inputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> Any:
        """``reduce_scatter_single``/``reduce_scatter_tensor``: ``output`` gets block
        ``rank`` of the reduced ``input`` (``size`` blocks of ``output.numel()``
        elements). ``output`` may be this rank's block of ``input`` (in place)."""
        opts = opts or dist.ReduceScatterOptions()
        op = reduce_op(opts, "reduce_scatter_tensor", self._rank)
        dense([output, input], "reduce_scatter_tensor", self._rank)
        check_count(input, output.numel() * self.size(), "input", "reduce_scatter_tensor",
                    self._rank)
        return self._reduce_scatter(opts, op, input.detach(), output, [input])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list, inputs: list,
                                        opts: Any = None) -> Any:
        for out, inp in zip(outputs, inputs):
            self.reduce_scatter_single(out, inp, None).wait()
        return done(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
