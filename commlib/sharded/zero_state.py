"""Full optimizer state of :class:`commlib.ZeroRedundancyOptimizer` from the ranks' shard
states, and a rank's shard state from a full one (torch's format, keyed by the global
parameter index): no communication here, the front-end moves the bytes.

A local optimizer steps one flat shard per (param group, kind) where the rank owns
elements (:mod:`commlib.sharded.flat_partition`). A state value that is a tensor of the
shard's shape (``exp_avg``, ``momentum_buffer``) is element-wise: the full value of a
parameter is cut from the ranks' shards; any other value (``step``) is the same on every
rank and taken from the first rank that owns elements of the parameter's group.
"""
from __future__ import annotations

from typing import Any

import torch

from .flat_partition import Kind


def shards_of(kinds: list[Kind], n_groups: int, rank: int) -> list[list[tuple[int, int, int]]]:
    """Per param group, ``rank``'s non-empty shards: (kind index, lo, hi) of its local
    flat, in kind order (the order of the local optimizer's parameters)."""
    out = []
    for g in range(n_groups):
        mine = []
        for k, kind in enumerate(kinds):
            lo, hi = kind.span(rank, g)
            if hi > lo:
                mine.append((k, lo, hi))
        out.append(mine)
    return out


def _elementwise(value: Any, numel: int) -> bool:
    """A shard's state value that is element-wise (a 1-D tensor of the shard's size)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel


def _param_elementwise(key: str, value: Any, param: torch.Tensor) -> bool:
    """A parameter's state value that is element-wise: a tensor of the parameter's shape
    (for a 0-dim parameter, any 0-dim value but torch's ``step``)."""
    return isinstance(value, torch.Tensor) and value.shape == param.shape and (
        value.dim() >= 1 or key != "step")


def _global_index(groups: list[list[torch.Tensor]]) -> dict[int, int]:
    return {id(p): i for i, p in enumerate(p for params in groups for p in params)}


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def full_state(kinds: list[Kind], groups: list[list[torch.Tensor]],
               local_states: list[dict]) -> dict[int, dict]:
    """Global parameter index -> its state, from every rank's local optimizer
    ``state_dict()["state"]`` (``local_states[r]``, keyed by local index)."""
    index = _global_index(groups)
    layouts = [shards_of(kinds, len(groups), r) for r in range(len(local_states))]
    out: dict[int, dict] = {}
    for g, params in enumerate(groups):
        for k, kind in enumerate(kinds):
            if g not in kind.segments:
                continue
            g_lo, g_hi = kind.segments[g]
            pieces: list[tuple[int, dict]] = []   # (rank, its state of this shard)
            for r, layout in enumerate(layouts):
                local = sum(len(s) for s in layout[:g])
                for j, (kk, _, _) in enumerate(layout[g]):
                    st = local_states[r].get(local + j)
                    if kk == k and st:
                        pieces.append((r, st))
            if not pieces:
                continue
            first_rank, first = pieces[0]
            numel = kind.span(first_rank, g)[1] - kind.span(first_rank, g)[0]
            merged: dict[str, Any] = {}
            elementwise = set()
            for key, value in first.items():
                if _elementwise(value, numel):
                    seg = value.new_zeros(g_hi - g_lo)
                    for r, st in pieces:
                        for s_at, cnt, at in kind.segment_pieces(r, g):
                            seg[s_at:s_at + cnt].copy_(st[key][at:at + cnt])
                    merged[key] = seg
                    elementwise.add(key)
                else:
                    merged[key] = value
            for p in params:
                if id(p) not in kind.offset:
                    continue
                lo = kind.offset[id(p)] - g_lo
                out[index[id(p)]] = {
                    key: v[lo:lo + p.numel()].view(p.shape).clone() if key in elementwise
                    else _copy(v) for key, v in merged.items()}
    return dict(sorted(out.items()))


def local_state(kinds: list[Kind], groups: list[list[torch.Tensor]], rank: int,
                saved: dict[int, dict]) -> dict[int, dict]:
    """``rank``'s local optimizer state (keyed by local index) cut from a full state
    (global index -> state). A shard none of whose parameters has state gets none; a
    parameter without state inside a shard that has some contributes zeros."""
    index = _global_index(groups)
    out: dict[int, dict] = {}
    local = 0
    for g, mine in enumerate(shards_of(kinds, len(groups), rank)):
        for k, lo, hi in mine:
            kind = kinds[k]
            members = [p for p in groups[g] if id(p) in kind.offset]
            with_state = [p for p in members if saved.get(index[id(p)])]
            if with_state:
                template = saved[index[id(with_state[0])]]
                st: dict[str, Any] = {}
                g_lo = kind.segments[g][0]
                for key, value in template.items():
                    if _param_elementwise(key, value, with_state[0]):
                        shard = value.new_zeros(hi - lo)
                        for s_at, cnt, sh in kind.segment_pieces(rank, g):
                            for piece in kind.pieces(g_lo + s_at, cnt, sh):
                                v = saved.get(index[id(piece.param)], {}).get(key)
                                if v is not None:
                                    shard[piece.at:piece.at + piece.n].copy_(
                                        v.reshape(-1)[piece.p_lo:piece.p_lo + piece.n])
                        st[key] = shard
                    else:
                        st[key] = _copy(value)
                out[local] = st
            local += 1
    return out
