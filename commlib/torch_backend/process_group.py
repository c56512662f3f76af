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

Every wait honours the group's ``timeout`` (:mod:`.deadlines`); every operation records a
``commlib:<op>`` profiler event (:mod:`.profiling`). In-place forms, where the input is
this rank's block of the output (``all_gather_into_tensor``, ``reduce_scatter_tensor``,
as torch's FSDP2 calls them) or overlaps it in any way, work on a copy of the input
(resp. into a separate output), decided by each rank from its own buffers: the MPI call
is the same out-of-place one on every rank. ``ReduceOp.AVG`` on integers has NCCL's
semantics (:func:`.convert.integer_average`); sparse tensors go to :mod:`.sparse`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import primitives as P
from ..base.options import options
from ..primitives import Group
from . import monitored, p2p, profiling, progress
from .convert import (
    as_list,
    check_count,
    check_list,
    dense,
    flatten,
    one,
    overlaps,
    unflatten,
    unsupported,
    where,
)
from .deadlines import GroupDeadlines, seconds
from .reductions import Reductions
from .work import CommlibWork, done


class ProcessGroupCommlib(Reductions, dist.ProcessGroup):
    """The process group torch gets from ``backend="commlib"``. ``group`` is the commlib
    group behind it (see :func:`commlib_group`); ``timeout``: the group's timeout (a
    ``timedelta``, as torch passes it; None: none)."""

    def __init__(self, group: Group, rank: int, size: int, timeout: Any = None) -> None:
        super().__init__(rank, size)
        self.group = group
        self._rank = rank
        self._size = size
        #: the completed handle returned to callers that pass ``asyncOp=False`` (see _launch)
        self._done = done([])
        self._background = progress.background()
        self._names = {"name": "", "desc": ""}
        self._deadlines = GroupDeadlines(timeout, rank, f"process group with world ranks "
                                                        f"{list(group.ranks)}")

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

    @property
    def timeout(self) -> float:
        """The group's timeout in seconds (``inf``: none)."""
        return self._deadlines.timeout_s

    def _set_default_timeout(self, timeout: Any) -> None:
        self._deadlines.set_timeout(timeout)

    def __repr__(self) -> str:
        return (f"<ProcessGroupCommlib rank={self.rank()} size={self.size()} "
                f"world ranks={list(self.group.ranks)}>")

    # -- running one commlib operation -----------------------------------------------
    def _blocking(self, op: str, call: Callable[[bool], Any]) -> Any:
        """Run ``call(async_op)`` to completion here, within the group's timeout; its
        value. Inside MPI (``call(False)``) when the timeout is not shorter than the
        watchdog's, else started non-blocking and tested until the deadline."""
        deadlines = self._deadlines
        deadlines.check(op)
        if deadlines.timeout_s >= options.timeout:
            return call(False)
        deadline = deadlines.deadline()
        return deadlines.wait(call(True), op, deadline)

    def _launch(self, op: str, opts: Any, call: Callable[[bool], Any], result: list,
                after: Callable[[Any], None] | None = None, inputs: list | None = None,
                outputs: list | tuple = ()) -> Any:
        """Run ``call(async_op)``, one commlib operation (``op``: torch's name of it, for
        errors and the profiler event). With ``opts.asyncOp`` (torch's C++ callers such as
        DDP, ``async_op=True``) it is started non-blocking and completed by the progress
        thread (:mod:`.progress`); otherwise it runs to the end here. ``after(value)`` gets
        the operation's return value once it is complete (to copy results out);
        ``result`` is the handle's future value; ``inputs``: the tensors of the profiler
        event (default ``result``)."""
        deadlines = self._deadlines
        if deadlines.broken is not None:
            deadlines.check(op)
        event = (profiling.start(op, result if inputs is None else inputs, self, outputs)
                 if profiling.enabled() else None)
        if self._background and getattr(opts, "asyncOp", False):
            deadline = deadlines.deadline()
            try:
                pending = call(True)
            except BaseException:
                profiling.end(event)
                raise
            return progress.submit(pending, result, after, deadlines, op, deadline, event)
        if event is None:  # no profiler: the common case, without the try
            value = (call(False) if deadlines.timeout_s >= options.timeout
                     else self._blocking(op, call))
            if after is not None:
                after(value)
            if getattr(opts, "asyncOp", True) is False:
                # torch.distributed's blocking calls (async_op=False) wait on the handle
                # and drop it: one completed handle per group serves them all (its result
                # and future are the last blocking call's; a new handle costs 0.7 us)
                handle = self._done
                handle._result = result
                handle._future = None
                return handle
            return done(result)
        try:
            value = self._blocking(op, call)
            if after is not None:
                after(value)
        finally:
            profiling.end(event)
        return done(result)

    # -- data movement -----------------------------------------------------------------
    def broadcast(self, tensors: list, opts: Any = None) -> Any:
        """Rank ``opts.rootRank``'s tensor into every rank's, in place."""
        opts = opts or dist.BroadcastOptions()
        root = opts.rootRank
        tensors = as_list(tensors)
        dense(tensors, "broadcast", self._rank)
        if len(tensors) == 1:
            t = tensors[0].detach()
            return self._launch("broadcast", opts,
                                lambda a: P.broadcast(t, root, self.group, a), tensors)
        for t in tensors:
            self._blocking("broadcast", lambda a: P.broadcast(t.detach(), root, self.group, a))
        return done(tensors)

    def allgather(self, output_lists: list, inputs: list, opts: Any = None) -> Any:
        """``all_gather``: ``output_lists[0][r]`` = rank ``r``'s ``inputs[0]``."""
        inp = one(inputs, "all_gather", self._rank).detach()
        outs = check_list(output_lists[0], self.size(), "tensor_list", "all_gather",
                          self._rank)
        dense([inp] + outs, "all_gather", self._rank)
        for o in outs:
            check_count(o, inp.numel(), "every output", "all_gather", self._rank)
        return self._launch("all_gather", opts, lambda a: P.allgather(inp, self.group, a),
                            outs, lambda rows: unflatten(rows.reshape(-1), outs), [inp])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> Any:
        """``all_gather_single``/``all_gather_into_tensor``: ``output`` = the inputs of
        ranks 0..size-1, one after the other. ``input`` may be this rank's block of
        ``output`` (in place, as torch's FSDP2 calls it)."""
        check_count(output, input.numel() * self.size(), "output", "all_gather_into_tensor",
                    self._rank)
        dense([output, input], "all_gather_into_tensor", self._rank)
        inp, into = input.detach(), output.detach()
        if overlaps(inp, into):
            inp = inp.clone(memory_format=torch.contiguous_format)
        return self._launch("all_gather", opts,
                            lambda a: P.allgather(inp, self.group, a, into), [output],
                            inputs=[input])

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists: list, inputs: list, opts: Any = None) -> Any:
        """``all_gather_coalesced``: ``output_lists[r][i]`` = rank ``r``'s ``inputs[i]``
        (torch's order: one list per rank). One exchange when the inputs share a dtype and
        device, else one per input."""
        n, rank = self.size(), self._rank
        inputs = list(inputs)
        output_lists = check_list(output_lists, n, "output_tensor_lists",
                                  "all_gather_coalesced", rank)
        dense(inputs + [o for outs in output_lists for o in outs], "all_gather_coalesced",
              rank)
        for outs in output_lists:
            if len(outs) != len(inputs):
                raise ValueError(f"{where('all_gather_coalesced', rank)}: every list of "
                                 f"output_tensor_lists must hold one tensor per input "
                                 f"({len(inputs)}), got {len(outs)}")
            for o, i in zip(outs, inputs):
                check_count(o, i.numel(), "every output", "all_gather_coalesced", rank)
        flat_outs = [o for outs in output_lists for o in outs]
        if len({(t.dtype, t.device) for t in inputs + flat_outs}) <= 1 and inputs:
            flat = flatten(inputs)
            return self._launch("all_gather", opts,
                                lambda a: P.allgather(flat, self.group, a), flat_outs,
                                lambda rows: unflatten(rows.reshape(-1), flat_outs), inputs)
        event = profiling.start("all_gather", inputs, self)
        try:
            for i, inp in enumerate(inputs):
                column = [output_lists[r][i] for r in range(n)]
                rows = self._blocking("all_gather_coalesced",
                                      lambda a: P.allgather(inp.detach(), self.group, a))
                unflatten(rows.reshape(-1), column)
        finally:
            profiling.end(event)
        return done(flat_outs)

    def all_gather_single_coalesced(self, outputs: list, inputs: list,
                                    opts: Any = None) -> Any:
        for out, inp in zip(outputs, inputs):
            self.all_gather_single(out, inp, None).wait()
        return done(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_lists: list, inputs: list, opts: Any = None) -> Any:
        """On ``opts.rootRank``: ``output_lists[0][r]`` = rank ``r``'s ``inputs[0]``."""
        opts = opts or dist.GatherOptions()
        root = opts.rootRank
        inp = one(inputs, "gather", self._rank).detach()
        outs: list = []
        if self._rank == root:
            outs = check_list(output_lists[0], self.size(), "gather_list", "gather",
                              self._rank)
            for o in outs:
                check_count(o, inp.numel(), "every output", "gather", self._rank)
        dense([inp] + outs, "gather", self._rank)

        def copy_out(rows: Any) -> None:
            if rows is not None:
                unflatten(rows.reshape(-1), outs)
        return self._launch("gather", opts, lambda a: P.gather(inp, root, self.group, a),
                            outs, copy_out, [inp])

    def scatter(self, outputs: list, input_lists: list, opts: Any = None) -> Any:
        """``outputs[0]`` = ``input_lists[0][rank]`` of rank ``opts.rootRank``."""
        opts = opts or dist.ScatterOptions()
        root = opts.rootRank
        out = one(outputs, "scatter", self._rank)
        data, inputs = None, []
        if self._rank == root:
            inputs = check_list(input_lists[0], self.size(), "scatter_list", "scatter",
                                self._rank)
            for t in inputs:
                check_count(t, out.numel(), "every input", "scatter", self._rank)
        dense([out] + inputs, "scatter", self._rank)
        if inputs:
            data = flatten(inputs)
        into = out.detach()
        return self._launch("scatter", opts,
                            lambda a: P.scatter(into, data, root, self.group, a),
                            list(outputs), inputs=inputs or list(outputs))

    def alltoall(self, outputs: list, inputs: list, opts: Any = None) -> Any:
        """``all_to_all``: ``outputs[i]`` = rank ``i``'s ``inputs[rank]`` (any sizes)."""
        n, rank = self.size(), self._rank
        outputs = check_list(outputs, n, "output_tensor_list", "all_to_all", rank)
        inputs = check_list(inputs, n, "input_tensor_list", "all_to_all", rank)
        dense(outputs + inputs, "all_to_all", rank)
        if len({t.dtype for t in outputs + inputs}) != 1:
            raise TypeError(f"{where('all_to_all', rank)}: all tensors must have one dtype")
        flat = flatten(inputs)
        send, recv = [t.numel() for t in inputs], [t.numel() for t in outputs]
        return self._launch("all_to_all", opts,
                            lambda a: P.alltoall_v(flat, send, recv, self.group, a),
                            outputs, lambda got: unflatten(got, outputs), inputs)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list, input_split_sizes: list,
                          opts: Any = None) -> Any:
        """Rows ``input_split_sizes[j]`` of ``input`` go to rank ``j``; ``output`` takes
        ``output_split_sizes[i]`` rows from rank ``i``. Empty split lists mean equal
        blocks of the leading dimension. ``output`` and ``input`` may overlap."""
        n, rank = self.size(), self._rank
        dense([output, input], "all_to_all_single", rank)
        inp, into = input.detach(), output.detach()
        if overlaps(inp, into):
            inp = inp.clone(memory_format=torch.contiguous_format)
        if not output_split_sizes and not input_split_sizes:
            return self._launch("all_to_all", opts,
                                lambda a: P.alltoall(inp, self.group, a, into), [output],
                                inputs=[input])
        send = list(input_split_sizes) or _equal(input, n, "input", rank)
        recv = list(output_split_sizes) or _equal(output, n, "output", rank)
        if output.dim() == 0 or output.shape[0] != sum(recv):
            raise ValueError(f"{where('all_to_all_single', rank)}: output has shape "
                             f"{tuple(output.shape)}, but output_split_sizes add up to "
                             f"{sum(recv)} rows")
        return self._launch("all_to_all", opts,
                            lambda a: P.alltoall_v(inp, send, recv, self.group, a, into),
                            [output], inputs=[input])

    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> Any:
        return self._launch("barrier", opts, lambda a: P.barrier(self.group, a), [])

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """See :func:`commlib.torch_backend.monitored_barrier` (torch's own
        ``dist.monitored_barrier`` accepts gloo groups only)."""
        timeout_s = seconds(timeout) or self._deadlines.timeout_s
        monitored.run(self.group, self._rank, timeout_s, wait_all_ranks)

    # -- point to point ----------------------------------------------------------------
    def send(self, tensors: list, dstRank: int, tag: int = 0) -> CommlibWork:
        return p2p.send(self, tensors, dstRank, tag)

    def recv(self, tensors: list, srcRank: int, tag: int = 0) -> CommlibWork:
        return p2p.recv(self, tensors, srcRank, tag)

    def recv_anysource(self, tensors: list, tag: int = 0) -> CommlibWork:
        return p2p.recv_anysource(self, tensors, tag)

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


def monitored_barrier(group: Any = None, timeout: Any = None,
                      wait_all_ranks: bool = False) -> None:
    """Synchronize the ranks of ``group`` (a process group of the commlib backend; None:
    the default group), naming the ranks that do not arrive within ``timeout`` (a
    ``timedelta``; None: the group's timeout). Raises ``DistBackendError`` on rank 0 naming
    the missing rank(s), and on the ranks that arrived when rank 0 does not acknowledge in
    time (see :mod:`.monitored`). Not a collective that other ranks can mix up: it is
    point-to-point on reserved tags."""
    from torch.distributed.distributed_c10d import _get_default_group, _rank_not_in_group
    if _rank_not_in_group(group):
        return
    pg = _get_default_group() if group is None else group
    if not isinstance(pg, ProcessGroupCommlib):
        raise TypeError(f"commlib.torch_backend.monitored_barrier: argument 'group' must be "
                        f"a process group of the commlib backend (or None for the default "
                        f"group), got {pg!r}; use torch.distributed.monitored_barrier for "
                        f"gloo groups")
    pg.monitored_barrier(timeout, wait_all_ranks)
