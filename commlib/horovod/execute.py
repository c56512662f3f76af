"""Running negotiated requests on a process set's data group (the controller's thread).

Arithmetic follows Horovod's CPU code: ``prescale_factor`` multiplies each rank's input
before the reduction and ``postscale_factor`` the result after it; ``Average`` is a sum
whose postscale factor is divided by the set size. Scaling multiplies in float64 for
integer tensors (the product truncated toward zero on the way back), in float32 for
float16/bfloat16 (rounded back to 16 bits) and float32, in float64 for float64. Allreduces
that became ready together with the same dtype, device, op and factors are fused into one
flat buffer (Horovod's tensor fusion; elementwise, so results are unchanged), up to
:data:`FUSION_BYTES`.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..base.reduce_ops import ReduceOp
from ..primitives import allgather, allgather_v, allreduce, alltoall_v, broadcast, reduce_scatter
from .adasum import adasum_combine
from .wire import inline_numpy_dtype

# Horovod's reduce-op values (horovod.common.basics).
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
            Product: "Product"}
WIRE = {Average: ReduceOp.SUM, Sum: ReduceOp.SUM, Min: ReduceOp.MIN, Max: ReduceOp.MAX,
        Product: ReduceOp.PRODUCT}
FUSION_BYTES = 64 << 20
_F32 = {torch.float16, torch.bfloat16, torch.float32}


def scale_(t: torch.Tensor, factor: float) -> torch.Tensor:
    """``t *= factor`` in place, in Horovod's precision (see the module docstring)."""
    if factor == 1.0 or t.dtype == torch.bool:
        return t
    if t.dtype in _F32:
        f = torch.tensor(np.float32(factor), dtype=torch.float32, device=t.device)
        if t.dtype == torch.float32:
            return t.mul_(f)
        return t.copy_(t.float().mul_(f).to(t.dtype))
    if t.is_floating_point() or t.is_complex():
        return t.mul_(factor)
    return t.copy_(t.double().mul_(factor).to(t.dtype))


def post_factor(op: int, post: float, n: int) -> float:
    return post / n if op == Average else post


# -- agreement ---------------------------------------------------------------------------
def _describe(metas: list, ranks: list) -> str:
    return "; ".join(f"rank {ranks[r]}: {m!r}" for r, m in enumerate(metas) if m is not None)


def check(name: str, metas: list, joined: set, ranks: list) -> str | None:
    """The error every rank reports for ``name``, or None when the ranks agree."""
    present = [m for m in metas if m is not None]
    kinds = {m[0] for m in present}
    if len(kinds) > 1:
        return (f"Mismatched collective operations for tensor {name!r}: "
                f"{_describe(metas, ranks)}")
    kind = present[0][0]
    if joined and kind != "allreduce":
        who = sorted(ranks[r] for r in joined if metas[r] is None)
        if who:
            return (f"{kind} {name!r} is not supported with Join: rank(s) {who} have already "
                    f"joined (only allreduce runs while ranks are joined)")
    if kind in ("allreduce", "reducescatter", "broadcast", "barrier"):
        if any(m != present[0] for m in present):
            return (f"Mismatched {kind} arguments for tensor {name!r} (shapes, dtypes, devices, "
                    f"op, scale factors and root must agree): {_describe(metas, ranks)}")
        return None
    if kind == "allgather":
        heads = {tuple((d, len(s), s[1:], dev) for d, s, dev in m[1]) for m in present}
        if len(heads) > 1:
            return (f"Mismatched allgather tensors for {name!r} (dtype, device, number of "
                    f"dimensions and every dimension but the first must agree): "
                    f"{_describe(metas, ranks)}")
        return None
    if kind == "alltoall":
        heads = {(m[1][0][0], len(m[1][0][1]), m[1][0][1][1:], m[1][0][2]) for m in present}
        if len(heads) > 1:
            return (f"Mismatched alltoall tensors for {name!r} (dtype, device, number of "
                    f"dimensions and every dimension but the first must agree): "
                    f"{_describe(metas, ranks)}")
        return None
    return f"unknown collective {kind!r} for {name!r}"


# -- execution ---------------------------------------------------------------------------
def run(ctrl: Any, batch: list) -> None:
    """Run ``batch`` (``(name, metas, request or None, inline data or None)`` in agreed
    order) on every rank."""
    rest = []
    for name, metas, req, inline in batch:
        if inline is None:
            rest.append((name, metas, req))
        else:
            inline_allreduce(ctrl, req, inline, metas)
    if rest:
        with torch.no_grad():   # this thread's grad mode: results never join a graph here
            _run(ctrl, rest)


_NP_COMBINE = {Average: np.add, Sum: np.add, Min: np.minimum, Max: np.maximum,
               Product: np.multiply}


def _np_scale(x: np.ndarray, factor: float) -> None:
    """:func:`scale_` on a numpy array of an inline dtype (float32, float64, integers)."""
    if x.dtype == np.float32:
        x *= np.float32(factor)
    elif x.dtype == np.float64:
        x *= factor
    else:
        x[...] = (x * factor).astype(x.dtype)   # float64 product, truncated toward zero


def inline_allreduce(ctrl: Any, req: Any, inline: np.ndarray, metas: Any = None) -> None:
    """A tiny allreduce whose inputs came inline with the negotiation round
    (:mod:`commlib.horovod.wire`; ``inline``: a (ranks, bytes) uint8 array, zeros for
    joined ranks): every rank reduces the same bytes in rank order
    (Horovod's arithmetic: prescale each input, combine, postscale); joined ranks count as
    zeros. No communication."""
    meta = req.meta if req is not None else next(m for m in metas if m is not None)
    _, op, pre, post, specs = meta
    try:   # numpy, in Horovod's precision (see scale_); the output through detach()
        x = inline.view(inline_numpy_dtype(meta))   # (ranks, numel)
        if pre != 1.0:
            _np_scale(x, pre)
        acc = x[0]
        combine = _NP_COMBINE[op]
        for r in range(1, ctrl.size):
            combine(acc, x[r], out=acc)
        post = post_factor(op, post, ctrl.size)
        if post != 1.0:
            _np_scale(acc, post)
        if req is not None:
            out = req.outputs[0]
            if out is None:
                req.outputs[0] = torch.from_numpy(acc.reshape(specs[0][1]))
            else:
                out.detach().view(-1).copy_(torch.from_numpy(acc))
    except Exception as exc:  # noqa: BLE001 - handed to the waiting caller
        if req is not None:
            req.finish(error=exc)
        return
    if req is not None:
        req.finish(req.outputs if req.params.get("grouped") else req.outputs[0])


def _run(ctrl: Any, batch: list) -> None:
    i = 0
    while i < len(batch):
        name, metas, req = batch[i]
        meta = next(m for m in metas if m is not None)
        kind = meta[0]
        try:
            if kind == "allreduce" and meta[1] != Adasum:
                j = i + 1
                total = _nbytes(meta)
                while j < len(batch) and total < FUSION_BYTES:
                    other = next(m for m in batch[j][1] if m is not None)
                    if not _fusable(meta, other):
                        break
                    total += _nbytes(other)
                    j += 1
                _allreduce(ctrl, batch[i:j])
                i = j
                continue
            result = RUNNERS[kind](ctrl, metas, req)
            if req is not None:
                req.finish(result)
        except Exception as exc:  # noqa: BLE001 - handed to the waiting caller
            if req is not None:
                req.finish(error=exc)
        i += 1


def _nbytes(meta: tuple) -> int:
    return sum(int(np.prod(s, dtype=np.int64)) * torch.empty((), dtype=getattr(torch, d))
               .element_size() for d, s, _ in meta[4])


def _fusable(a: tuple, b: tuple) -> bool:
    return (b[0] == "allreduce" and a[1:4] == b[1:4]
            and {(d, dev) for d, _, dev in a[4]} == {(d, dev) for d, _, dev in b[4]}
            and len({(d, dev) for d, _, dev in a[4]}) == 1)


def _zeros(spec: tuple) -> torch.Tensor:
    dtype, shape, dev = spec
    return torch.zeros(shape, dtype=getattr(torch, dtype), device=dev)


def _allreduce(ctrl: Any, entries: list) -> None:
    """A fused allreduce of every tensor of ``entries`` (same dtype, device, op, factors)."""
    meta = next(m for m in entries[0][1] if m is not None)
    op, pre, post = meta[1], meta[2], meta[3]
    slots = []   # (request or None, index, numel)
    for _, metas, req in entries:
        specs = next(m for m in metas if m is not None)[4]
        for k, spec in enumerate(specs):
            slots.append((req, k, int(np.prod(spec[1], dtype=np.int64)), spec))
    dtype, _, dev = meta[4][0]
    try:
        single = len(slots) == 1 and slots[0][0] is not None
        for req, k, _, _ in slots:
            if req is not None and req.outputs[k] is None:   # out of place: made here
                req.outputs[k] = torch.empty_like(req.inputs[k],
                                                  memory_format=torch.contiguous_format)
        if single:
            req = slots[0][0]
            out = req.outputs[0]
            if out is not req.inputs[0]:
                out.copy_(req.inputs[0])
            flat = out
        else:
            flat = torch.empty(sum(s[2] for s in slots), dtype=getattr(torch, dtype), device=dev)
            o = 0
            for req, k, n, _ in slots:
                if req is None:
                    flat[o:o + n].zero_()
                else:
                    flat[o:o + n].copy_(req.inputs[k].reshape(-1))
                o += n
        scale_(flat, pre)
        allreduce(flat, op=WIRE[op], group=ctrl.data)
        scale_(flat, post_factor(op, post, ctrl.size))
        if not single:
            o = 0
            for req, k, n, _ in slots:
                if req is not None:
                    req.outputs[k].copy_(flat[o:o + n].view_as(req.outputs[k]))
                o += n
    except Exception as exc:  # noqa: BLE001
        for _, _, req in entries:
            if req is not None:
                req.finish(error=exc)
        return
    for _, _, req in entries:
        if req is not None:
            req.finish(req.outputs if req.params.get("grouped") else req.outputs[0])


def _adasum(ctrl: Any, metas: list, req: Any) -> Any:
    meta = next(m for m in metas if m is not None)
    pre, post = meta[2], meta[3]
    outs = []
    for k, spec in enumerate(meta[4]):
        t = (req.inputs[k] if req is not None else _zeros(spec)).clone()
        scale_(t, pre)
        gathered = allgather(t.contiguous(), group=ctrl.data)
        result = adasum_combine(list(gathered))
        scale_(result, post)
        if req is not None:
            if req.outputs[k] is None:
                req.outputs[k] = torch.empty_like(req.inputs[k],
                                                  memory_format=torch.contiguous_format)
            req.outputs[k].copy_(result.view_as(req.outputs[k]))
            outs.append(req.outputs[k])
    if req is None:
        return None
    return outs if req.params.get("grouped") else outs[0]


def _allgather(ctrl: Any, metas: list, req: Any) -> Any:
    outs = []
    for t in req.inputs:
        t = t.reshape(1) if t.dim() == 0 else t.contiguous()
        outs.append(torch.cat(allgather_v(t, group=ctrl.data), 0))
    return outs if req.params.get("grouped") else outs[0]


def _broadcast(ctrl: Any, metas: list, req: Any) -> Any:
    root = metas[0][1]
    out = req.outputs[0]
    if out is not req.inputs[0] and ctrl.rank == root:
        out.copy_(req.inputs[0])
    broadcast(out, src=root, group=ctrl.data)
    return out


def _alltoall(ctrl: Any, metas: list, req: Any) -> Any:
    n, me = ctrl.size, ctrl.rank

    def splits_of(m: tuple) -> list:
        return list(m[2]) if m[2] is not None else [m[1][0][1][0] // n] * n

    recv = [splits_of(m)[me] for m in metas]
    send = splits_of(metas[me])
    t = req.inputs[0]
    t = t.reshape(1) if t.dim() == 0 else t.contiguous()
    out = alltoall_v(t, send, recv, group=ctrl.data)
    return out, torch.tensor(recv, dtype=torch.int32)


def _reducescatter(ctrl: Any, metas: list, req: Any) -> Any:
    meta = metas[0]
    op, pre, post = meta[1], meta[2], meta[3]
    n, me = ctrl.size, ctrl.rank
    outs = []
    for t in req.inputs:
        dim0, rest = t.shape[0], tuple(t.shape[1:])
        rows = [dim0 // n + (1 if r < dim0 % n else 0) for r in range(n)]
        most = max(rows)
        padded = t.new_zeros((n * most,) + rest)
        o = 0
        for r in range(n):
            padded[r * most:r * most + rows[r]].copy_(t[o:o + rows[r]])
            o += rows[r]
        scale_(padded, pre)
        block = reduce_scatter(padded.reshape(-1), op=WIRE[op], group=ctrl.data)
        row = int(np.prod(rest, dtype=np.int64))
        out = block[:rows[me] * row].reshape((rows[me],) + rest).clone()
        outs.append(scale_(out, post_factor(op, post, n)))
    return outs if req.params.get("grouped") else outs[0]


def _barrier(ctrl: Any, metas: list, req: Any) -> Any:
    return None  # every rank announced it: that round was the barrier


def _run_adasum_or_allreduce(ctrl: Any, metas: list, req: Any) -> Any:
    return _adasum(ctrl, metas, req)


RUNNERS = {"allreduce": _run_adasum_or_allreduce, "allgather": _allgather,
           "broadcast": _broadcast, "alltoall": _alltoall, "reducescatter": _reducescatter,
           "barrier": _barrier}
