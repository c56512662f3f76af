"""``ProcessGroupCommlib``: a ``torch.distributed.ProcessGroup`` whose operations are
commlib's MPI collectives on a :class:`commlib.Group`.

Collectives called with ``async_op=False`` run to completion in the calling thread (no
thread hop on the latency-bound path) and return a completed handle. With ``async_op=True``
and from torch's C++ callers (DDP's buckets, whose options default to asynchronous), they
start as non-blocking MPI requests, in call order, and a progress thread completes them
(:mod:`.progress`), so DDP's exchanges overlap its backward pass. Point-to-point
operations are non-blocking requests the caller completes (:mod:`.p2p`). Tensors on CPU
and CUDA devices are accepted (CUDA ones through commlib's staging or CUDA-aware path).
Ranks (``rootRank``, ``src``, ``dst``) are ranks in this group, as torch passes them.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import primitives as P
from ..primitives import Group
from . import p2p, progress
from .convert import check_count, check_list, reduce_op, unsupported, where
from .work import CommlibWork, done


def _flat(tensors: list) -> torch.Tensor:
    """One contiguous 1-D tensor holding ``tensors`` one after the other."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _unflatten(flat: torch.Tensor, tensors: list) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.detach().copy_(flat[offset:offset + n].view_as(t))
            offset += n


class ProcessGroupCommlib(dist.ProcessGroup):
    """The process group torch gets from ``backend="commlib"``. ``group`` is the commlib
    group behind it (see :func:`commlib_group`)."""

    def __init__(self, group: Group, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.group = group
        self._rank = rank
        self._background = progress.background()
        self._names = {"name": "", "desc": ""}

    # -- identity ----------------------------------------------------------------------
    def getBackendName(self) -> str:
        return "commlib"

    def name(self) -> str:
        return "commlib"

    def getGroupName(self) -> str:
        return self._names["name"]

    def setGroupName(self, name: str) -> None:
        self._names["name"] = name

    def getGroupDesc(self) -> str:
        return self._names["desc"]

    def setGroupDesc(self, desc: str) -> None:
        self._names["desc"] = desc

    _set_group_name = setGroupName
    _set_group_desc = setGroupDesc
    group_name = property(getGroupName)
    group_desc = property(getGroupDesc)

    def __repr__(self) -> str:
        return (f"<ProcessGroupCommlib rank={self.rank()} size={self.size()} "
                f"world ranks={list(self.group.ranks)}>")

    # -- running one commlib operation -----------------------------------------------
    def _launch(self, opts: Any, call: Callable[[bool], Any], result: list,
                after: Callable[[Any], None] | None = None) -> Any:
        """Run ``call(async_op)``, one commlib operation. With ``opts.asyncOp`` (torch's
        C++ callers such as DDP, ``async_op=True``) it is started non-blocking and
        completed by the progress thread (:mod:`.progress`); otherwise it runs to the end
        here. ``after(value)`` gets the operation's return value once it is complete (to
        copy results out); ``result`` is the handle's future value."""
        if self._background and getattr(opts, "asyncOp", False):
            return progress.submit(call(True), result, after)
        value = call(False)
        if after is not None:
            after(value)
        return done(result)

    # -- reductions --------------------------------------------------------------------
    def allreduce(self, tensors: list, opts: Any = None) -> Any:
        """In place on every rank: ``all_reduce``."""
        opts = opts or dist.AllreduceOptions()
        op = reduce_op(opts, "all_reduce", self._rank)
        tensors = _as_list(tensors)
        if len(tensors) == 1:
            t = tensors[0].detach()
            return self._launch(opts, lambda a: P.allreduce(t, op, self.group, a), tensors)
        for t in tensors:
            P.allreduce(t.detach(), op, self.group)
        return done(tensors)

    def allreduce_coalesced(self, tensors: list, opts: Any = None) -> Any:
        """All tensors in one exchange per dtype and device (flattened, then copied back)."""
        opts = opts or dist.AllreduceCoalescedOptions()
        op = reduce_op(opts, "all_reduce_coalesced", self._rank)
        kinds: dict[tuple, list] = {}
        for t in tensors:
            kinds.setdefault((t.dtype, t.device), []).append(t)
        if len(kinds) == 1:
            flat = _flat(tensors)
            return self._launch(opts, lambda a: P.allreduce(flat, op, self.group, a), tensors,
                                lambda _: _unflatten(flat, tensors))
        for same in kinds.values():
            flat = _flat(same)
            P.allreduce(flat, op, self.group)
            _unflatten(flat, same)
        return done(tensors)

    def reduce(self, tensors: list, opts: Any = None) -> Any:
        """Result in place on ``opts.rootRank``; other ranks' tensors unchanged."""
        opts = opts or dist.ReduceOptions()
        op = reduce_op(opts, "reduce", self._rank)
        t = _one(tensors, "reduce", self._rank).detach()
        return self._launch(opts, lambda a: P.reduce(t, opts.rootRank, op, self.group, a),
                            list(tensors))

    def reduce_scatter(self, outputs: list, input_lists: list, opts: Any = None) -> Any:
        """``outputs[0]`` = reduction over ranks of ``input_lists[0][rank]``."""
        opts = opts or dist.ReduceScatterOptions()
        op = reduce_op(opts, "reduce_scatter", self._rank)
        out = _one(outputs, "reduce_scatter", self._rank)
        inputs = check_list(input_lists[0], self.size(), "input_list", "reduce_scatter",
                            self._rank)
        for t in inputs:
            check_count(t, out.numel(), "every input", "reduce_scatter", self._rank)
        flat, into = _flat(inputs), out.detach()
        return self._launch(opts, lambda a: P.reduce_scatter(flat, op, self.group, a, into),
                            list(outputs))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> Any:
        """``reduce_scatter_single``/``reduce_scatter_tensor``: ``output`` gets block
        ``rank`` of the reduced ``input`` (``size`` blocks of ``output.numel()``
        elements)."""
        opts = opts or dist.ReduceScatterOptions()
        op = reduce_op(opts, "reduce_scatter_tensor", self._rank)
        check_count(input, output.numel() * self.size(), "input", "reduce_scatter_tensor",
                    self._rank)
        inp, into = input.detach(), output.detach()
        return self._launch(opts, lambda a: P.reduce_scatter(inp, op, self.group, a, into),
                            [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list, inputs: list,
                                        opts: Any = None) -> Any:
        for out, inp in zip(outputs, inputs):
            self.reduce_scatter_single(out, inp, opts).wait()
        return done(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement -----------------------------------------------------------------
    def broadcast(self, tensors: list, opts: Any = None) -> Any:
        """Rank ``opts.rootRank``'s tensor into every rank's, in place."""
        opts = opts or dist.BroadcastOptions()
        root = opts.rootRank
        tensors = _as_list(tensors)
        if len(tensors) == 1:
            t = tensors[0].detach()
            return self._launch(opts, lambda a: P.broadcast(t, root, self.group, a), tensors)
        for t in tensors:
            P.broadcast(t.detach(), root, self.group)
        return done(tensors)

    def allgather(self, output_lists: list, inputs: list, opts: Any = None) -> Any:
        """``all_gather``: ``output_lists[0][r]`` = rank ``r``'s ``inputs[0]``."""
        inp = _one(inputs, "all_gather", self._rank).detach()
        outs = check_list(output_lists[0], self.size(), "tensor_list", "all_gather",
                          self._rank)
        for o in outs:
            check_count(o, inp.numel(), "every output", "all_gather", self._rank)
        return self._launch(opts, lambda a: P.allgather(inp, self.group, a), outs,
                            lambda rows: _unflatten(rows.reshape(-1), outs))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> Any:
        """``all_gather_single``/``all_gather_into_tensor``: ``output`` = the inputs of
        ranks 0..size-1, one after the other."""
        check_count(output, input.numel() * self.size(), "output", "all_gather_into_tensor",
                    self._rank)
        inp, into = input.detach(), output.detach()
        return self._launch(opts, lambda a: P.allgather(inp, self.group, a, into), [output])

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists: list, inputs: list, opts: Any = None) -> Any:
        for outs, inp in zip(output_lists, inputs):
            self.allgather([outs], [inp], opts).wait()
        return done([o for outs in output_lists for o in outs])

    def all_gather_single_coalesced(self, outputs: list, inputs: list,
                                    opts: Any = None) -> Any:
        for out, inp in zip(outputs, inputs):
            self.all_gather_single(out, inp, opts).wait()
        return done(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_lists: list, inputs: list, opts: Any = None) -> Any:
        """On ``opts.rootRank``: ``output_lists[0][r]`` = rank ``r``'s ``inputs[0]``."""
        opts = opts or dist.GatherOptions()
        root = opts.rootRank
        inp = _one(inputs, "gather", self._rank).detach()
        outs: list = []
        if self._rank == root:
            outs = check_list(output_lists[0], self.size(), "gather_list", "gather",
                              self._rank)
            for o in outs:
                check_count(o, inp.numel(), "every output", "gather", self._rank)

        def copy_out(rows: Any) -> None:
            if rows is not None:
                _unflatten(rows.reshape(-1), outs)
        return self._launch(opts, lambda a: P.gather(inp, root, self.group, a), outs,
                            copy_out)

    def scatter(self, outputs: list, input_lists: list, opts: Any = None) -> Any:
        """``outputs[0]`` = ``input_lists[0][rank]`` of rank ``opts.rootRank``."""
        opts = opts or dist.ScatterOptions()
        root = opts.rootRank
        out = _one(outputs, "scatter", self._rank)
        data = None
        if self._rank == root:
            inputs = check_list(input_lists[0], self.size(), "scatter_list", "scatter",
                                self._rank)
            for t in inputs:
                check_count(t, out.numel(), "every input", "scatter", self._rank)
            data = _flat(inputs)
        into = out.detach()
        return self._launch(opts, lambda a: P.scatter(into, data, root, self.group, a),
                            list(outputs))

    def alltoall(self, outputs: list, inputs: list, opts: Any = None) -> Any:
        """``all_to_all``: ``outputs[i]`` = rank ``i``'s ``inputs[rank]`` (any sizes)."""
        n, rank = self.size(), self._rank
        outputs = check_list(outputs, n, "output_tensor_list", "all_to_all", rank)
        inputs = check_list(inputs, n, "input_tensor_list", "all_to_all", rank)
        if len({t.dtype for t in outputs + inputs}) != 1:
            raise TypeError(f"{where('all_to_all', rank)}: all tensors must have one dtype")
        flat = _flat(inputs)
        send, recv = [t.numel() for t in inputs], [t.numel() for t in outputs]
        return self._launch(opts, lambda a: P.alltoall_v(flat, send, recv, self.group, a),
                            outputs, lambda got: _unflatten(got, outputs))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list, input_split_sizes: list,
                          opts: Any = None) -> Any:
        """Rows ``input_split_sizes[j]`` of ``input`` go to rank ``j``; ``output`` takes
        ``output_split_sizes[i]`` rows from rank ``i``. Empty split lists mean equal
        blocks of the leading dimension."""
        n, rank = self.size(), self._rank
        inp, into = input.detach(), output.detach()
        if not output_split_sizes and not input_split_sizes:
            return self._launch(opts, lambda a: P.alltoall(inp, self.group, a, into),
                                [output])
        send = list(input_split_sizes) or _equal(input, n, "input", rank)
        recv = list(output_split_sizes) or _equal(output, n, "output", rank)
        if output.dim() == 0 or output.shape[0] != sum(recv):
            raise ValueError(f"{where('all_to_all_single', rank)}: output has shape "
                             f"{tuple(output.shape)}, but output_split_sizes add up to "
                             f"{sum(recv)} rows")
        return self._launch(opts, lambda a: P.alltoall_v(inp, send, recv, self.group, a,
                                                         into), [output])

    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> Any:
        return self._launch(opts, lambda a: P.barrier(self.group, a), [])

    # -- point to point ----------------------------------------------------------------
    def send(self, tensors: list, dstRank: int, tag: int = 0) -> CommlibWork:
        return p2p.send(self.group, tensors, dstRank, tag)

    def recv(self, tensors: list, srcRank: int, tag: int = 0) -> CommlibWork:
        return p2p.recv(self.group, tensors, srcRank, tag)

    def recv_anysource(self, tensors: list, tag: int = 0) -> CommlibWork:
        return p2p.recv_anysource(self.group, tensors, tag)

    # -- lifetime and the rest ---------------------------------------------------------
    def shutdown(self) -> None:
        """``destroy_process_group``: release the MPI communicators (every member)."""
        self.group.free()

    def abort(self) -> None:
        raise unsupported("abort", self.rank(), "MPI cannot abort one communicator; "
                          "use destroy_process_group()")

    def _start_coalescing(self, device: Any) -> None:
        raise unsupported("_coalescing_manager", self.rank(), "batch_isend_irecv and "
                          "all_reduce_coalesced work without it")

    def _end_coalescing(self, device: Any) -> None:
        raise unsupported("_coalescing_manager", self.rank())

    def split_group(self, *args: Any, **kwargs: Any) -> None:
        raise unsupported("split_group", self.rank(), "use new_group(ranks, "
                          "backend='commlib')")

    def merge_remote_group(self, *args: Any, **kwargs: Any) -> None:
        raise unsupported("merge_remote_group", self.rank())

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> None:
        raise unsupported("monitored_barrier", self.rank(), "commlib's watchdog "
                          "(COMMLIB_TIMEOUT) names a missing rank's pending operation")


def _one(tensors: Any, op: str, rank: int) -> Any:
    if len(tensors) != 1:
        raise ValueError(f"{where(op, rank)}: the commlib backend takes one tensor per rank "
                         f"here, got {len(tensors)}")
    return tensors[0]


def _as_list(tensors: Any) -> list:
    return tensors if tensors.__class__ is list else (
        [tensors] if isinstance(tensors, torch.Tensor) else list(tensors))


def _equal(t: torch.Tensor, n: int, what: str, rank: int) -> list[int]:
    if t.dim() == 0 or t.shape[0] % n:
        raise ValueError(f"{where('all_to_all_single', rank)}: without split sizes the "
                         f"{what}'s leading dimension must be divisible by the group size "
                         f"{n}, got shape {tuple(t.shape)}")
    return [t.shape[0] // n] * n


def commlib_group(pg: Any) -> Group | None:
    """The :class:`commlib.Group` behind ``pg`` when ``pg`` is a process group of the
    commlib backend (``init_process_group("commlib")``, ``new_group(...,
    backend="commlib")``); ``None`` for any other object, ``None`` included. On ranks
    outside a group torch hands out no process group, so there is nothing to look up."""
    return pg.group if isinstance(pg, ProcessGroupCommlib) else None
