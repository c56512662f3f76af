"""``ProcessGroupCommlib``: a ``torch.distributed.ProcessGroup`` whose operations are
commlib's MPI collectives on a :class:`commlib.Group`.

Collectives run to completion in the calling thread and return a completed handle, also
with ``async_op=True``: MPI progresses a request only inside MPI calls, so on CPU a
non-blocking collective overlaps little without a progress thread, torch's DDP asks for
the future right after starting each bucket, and a blocking call keeps ordering and
errors simple (every rank calls collectives in the same order anyway). Point-to-point
operations are non-blocking (:mod:`.p2p`). Tensors on CPU and CUDA devices are accepted
(CUDA ones through commlib's staging or CUDA-aware path). Ranks (``rootRank``, ``src``,
``dst``) are ranks in this group, as torch passes them.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import primitives as P
from ..primitives import Group
from . import p2p
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

    # -- reductions --------------------------------------------------------------------
    def allreduce(self, tensors: list, opts: Any = None) -> CommlibWork:
        """In place on every rank: ``all_reduce``."""
        op = reduce_op(opts or dist.AllreduceOptions(), "all_reduce", self._rank)
        tensors = _as_list(tensors)
        for t in tensors:
            P.allreduce(t.detach(), op, self.group)
        return done(tensors)

    def allreduce_coalesced(self, tensors: list, opts: Any = None) -> CommlibWork:
        """All tensors in one exchange per dtype and device (flattened, then copied back)."""
        op = reduce_op(opts or dist.AllreduceCoalescedOptions(), "all_reduce_coalesced",
                       self.rank())
        kinds: dict[tuple, list] = {}
        for t in tensors:
            kinds.setdefault((t.dtype, t.device), []).append(t)
        for same in kinds.values():
            flat = _flat(same)
            P.allreduce(flat, op, self.group)
            _unflatten(flat, same)
        return done(tensors)

    def reduce(self, tensors: list, opts: Any = None) -> CommlibWork:
        """Result in place on ``opts.rootRank``; other ranks' tensors unchanged."""
        opts = opts or dist.ReduceOptions()
        op = reduce_op(opts, "reduce", self.rank())
        for t in tensors:
            P.reduce(t.detach(), opts.rootRank, op, self.group)
        return done(tensors)

    def reduce_scatter(self, outputs: list, input_lists: list, opts: Any = None) -> CommlibWork:
        """``outputs[0]`` = reduction over ranks of ``input_lists[0][rank]``."""
        op = reduce_op(opts or dist.ReduceScatterOptions(), "reduce_scatter", self.rank())
        for out, inputs in zip(outputs, input_lists):
            inputs = check_list(inputs, self.size(), "input_list", "reduce_scatter",
                                self.rank())
            for t in inputs:
                check_count(t, out.numel(), "every input", "reduce_scatter", self.rank())
            P.reduce_scatter(_flat(inputs), op, self.group, out=out.detach())
        return done(outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> CommlibWork:
        """``reduce_scatter_tensor``: ``output`` gets block ``rank`` of the reduced
        ``input`` (``size`` blocks of ``output.numel()`` elements)."""
        op = reduce_op(opts or dist.ReduceScatterOptions(), "reduce_scatter_tensor",
                       self.rank())
        check_count(input, output.numel() * self.size(), "input", "reduce_scatter_tensor",
                    self.rank())
        P.reduce_scatter(input.detach(), op, self.group, out=output.detach())
        return done([output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list, inputs: list,
                                        opts: Any = None) -> CommlibWork:
        for out, inp in zip(outputs, inputs):
            self.reduce_scatter_single(out, inp, opts)
        return done(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement -----------------------------------------------------------------
    def broadcast(self, tensors: list, opts: Any = None) -> CommlibWork:
        """Rank ``opts.rootRank``'s tensor into every rank's, in place."""
        root = (opts or dist.BroadcastOptions()).rootRank
        tensors = _as_list(tensors)
        for t in tensors:
            P.broadcast(t.detach(), root, self.group)
        return done(tensors)

    def allgather(self, output_lists: list, inputs: list, opts: Any = None) -> CommlibWork:
        """``all_gather``: ``output_lists[0][r]`` = rank ``r``'s ``inputs[0]``."""
        for outs, inp in zip(output_lists, inputs):
            outs = check_list(outs, self.size(), "tensor_list", "all_gather", self.rank())
            for o in outs:
                check_count(o, inp.numel(), "every output", "all_gather", self.rank())
            rows = P.allgather(inp.detach(), self.group)
            _unflatten(rows.reshape(-1), outs)
        return done([o for outs in output_lists for o in outs])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> CommlibWork:
        """``all_gather_into_tensor``: ``output`` = the inputs of ranks 0..size-1, one
        after the other."""
        check_count(output, input.numel() * self.size(), "output", "all_gather_into_tensor",
                    self.rank())
        P.allgather(input.detach(), self.group, out=output.detach())
        return done([output])

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists: list, inputs: list,
                            opts: Any = None) -> CommlibWork:
        for outs, inp in zip(output_lists, inputs):
            self.allgather([outs], [inp], opts)
        return done([o for outs in output_lists for o in outs])

    def all_gather_single_coalesced(self, outputs: list, inputs: list,
                                    opts: Any = None) -> CommlibWork:
        for out, inp in zip(outputs, inputs):
            self.all_gather_single(out, inp, opts)
        return done(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_lists: list, inputs: list, opts: Any = None) -> CommlibWork:
        """On ``opts.rootRank``: ``output_lists[0][r]`` = rank ``r``'s ``inputs[0]``."""
        root = (opts or dist.GatherOptions()).rootRank
        inp = inputs[0]
        rows = P.gather(inp.detach(), root, self.group)
        if self.rank() != root:
            return done([])
        outs = check_list(output_lists[0], self.size(), "gather_list", "gather", self.rank())
        for o in outs:
            check_count(o, inp.numel(), "every output", "gather", self.rank())
        _unflatten(rows.reshape(-1), outs)
        return done(outs)

    def scatter(self, outputs: list, input_lists: list, opts: Any = None) -> CommlibWork:
        """``outputs[0]`` = ``input_lists[0][rank]`` of rank ``opts.rootRank``."""
        root = (opts or dist.ScatterOptions()).rootRank
        out = outputs[0]
        data = None
        if self.rank() == root:
            inputs = check_list(input_lists[0], self.size(), "scatter_list", "scatter",
                                self.rank())
            for t in inputs:
                check_count(t, out.numel(), "every input", "scatter", self.rank())
            data = _flat(inputs)
        P.scatter(out.detach(), data, root, self.group)
        return done([out])

    def alltoall(self, outputs: list, inputs: list, opts: Any = None) -> CommlibWork:
        """``all_to_all``: ``outputs[i]`` = rank ``i``'s ``inputs[rank]`` (any sizes)."""
        n, rank = self.size(), self.rank()
        outputs = check_list(outputs, n, "output_tensor_list", "all_to_all", rank)
        inputs = check_list(inputs, n, "input_tensor_list", "all_to_all", rank)
        if len({t.dtype for t in outputs + inputs}) != 1:
            raise TypeError(f"{where('all_to_all', rank)}: all tensors must have one dtype")
        got = P.alltoall_v(_flat(inputs), [t.numel() for t in inputs],
                           [t.numel() for t in outputs], self.group)
        _unflatten(got, outputs)
        return done(outputs)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list, input_split_sizes: list,
                          opts: Any = None) -> CommlibWork:
        """Rows ``input_split_sizes[j]`` of ``input`` go to rank ``j``; ``output`` takes
        ``output_split_sizes[i]`` rows from rank ``i``. Empty split lists mean equal
        blocks of the leading dimension."""
        n, rank = self.size(), self.rank()
        if not output_split_sizes and not input_split_sizes:
            P.alltoall(input.detach(), self.group, out=output.detach())
            return done([output])
        send = list(input_split_sizes) or _equal(input, n, "input", rank)
        recv = list(output_split_sizes) or _equal(output, n, "output", rank)
        if output.dim() == 0 or output.shape[0] != sum(recv):
            raise ValueError(f"{where('all_to_all_single', rank)}: output has shape "
                             f"{tuple(output.shape)}, but output_split_sizes add up to "
                             f"{sum(recv)} rows")
        P.alltoall_v(input.detach(), send, recv, self.group, out=output.detach())
        return done([output])

    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> CommlibWork:
        P.barrier(self.group)
        return done([])

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
