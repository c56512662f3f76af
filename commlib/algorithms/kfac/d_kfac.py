"""``d_kfac``: classic distributed K-FAC.

Per step, on every rank: gradients are averaged (allreduce); on factor steps every rank
builds every layer's factors from its local batch and the running averages are
allreduce-averaged, fused into buckets of ``bucket_cap_mb``, so every rank holds the
factors of the global batch; on inverse steps each layer's owner inverts its factors and
the inverses of all layers are shared in one ``allgather_v``; then every rank
preconditions every layer.

Bytes handed to MPI per step, on each rank: the gradient allreduce; on factor steps an
allreduce of ``sum(d_in^2 + d_out^2)`` elements; on inverse steps an ``allgather_v`` of the
inverses this rank owns (see :func:`.inverses.inverse_numel`) and its 16-byte shape exchange.
"""
from __future__ import annotations

import torch

from ...base.errors import NonFiniteError
from ...base.reduce_ops import ReduceOp
from ...primitives import allgather_v, allreduce
from ...primitives.finite import all_finite
from .. import state
from ..base import Context
from ..buckets import build
from .core import KFAC, Result
from .factors import update_running
from .inverses import compute_inverse, inverse_shapes, precondition
from .layers import KFACLayer
from .packing import views


class DKFAC(KFAC):
    """Distributed K-FAC with factor allreduce (see the module docstring and :class:`KFAC`
    for the hyperparameters). Every rank holds every layer's factors and inverses."""

    holds_every_factor = True

    def _captured_layers(self) -> list[KFACLayer]:
        return self._layers

    def _allocate(self, ctx: Context) -> None:
        """Running factors live in fused buckets, allreduced in place."""
        named = []
        for layer in self._layers:
            w = layer.module.weight
            named.append((f"{layer.index}.A", _placeholder(w, layer.d_in)))
            named.append((f"{layer.index}.G", _placeholder(w, layer.d_out)))
        self._buckets = build(named, ctx.bucket_cap_bytes)
        by_name = {n: v for b in self._buckets for n, v in zip(b.names, b.views)}
        self._factors: dict[int, list[torch.Tensor]] = {
            ly.index: [by_name[f"{ly.index}.A"], by_name[f"{ly.index}.G"]] for ly in self._layers}
        self._inverses: dict[int, list[torch.Tensor]] = {}

    def _factor_items(self) -> list[tuple[int, tuple[torch.Tensor, torch.Tensor]]]:
        return [(i, tuple(ag)) for i, ag in self._factors.items()]

    def _inverse_items(self) -> list[tuple[int, list[torch.Tensor]]]:
        return list(self._inverses.items())

    def _load_factors(self, factors: dict[int, list[torch.Tensor]]) -> None:
        for index, held in self._factors.items():
            for view, saved in zip(held, factors[index]):
                state.copy_into(view, saved)

    def _update_factors(self, ctx: Context, first: bool) -> None:
        """Local running averages, then one allreduce (average) per bucket, launched as soon
        as the bucket is updated so communication overlaps with the next bucket's update.
        Averaging the running averages equals averaging the batch factors, because every
        rank starts from the same (previously averaged) values. A layer this rank did not see
        contributes zero factors."""
        pending = []
        for bucket in self._buckets:
            with self._timers.phase("factors"):
                for name, view in zip(bucket.names, bucket.views):
                    index, which = name.split(".")
                    fresh = self._capture.batch_factor(self._layers[int(index)], which)
                    update_running(view, fresh if fresh is not None else torch.zeros_like(view),
                                   self.factor_decay, first)
            pending.append(ctx.submit(allreduce, bucket.flat, ReduceOp.AVG, ctx.group, True,
                                      self.hierarchical))
        with self._timers.phase("communication"):
            for future in pending:
                future.result()
        if not all(all_finite(b.flat) for b in self._buckets):  # averaged: same everywhere
            raise NonFiniteError(f"d_kfac (rank {ctx.rank}): the averaged Kronecker factors "
                                 f"are not finite while the gradients are (activations or "
                                 f"output gradients overflow); lower the learning rate or "
                                 f"the loss scale")

    def _update_inverses(self, ctx: Context) -> None:
        """Owners invert; one allgather_v shares every inverse; every rank (owners included)
        keeps views into the gathered buffer, so all use the same bits."""
        with self._timers.phase("inverses"):
            parts = [t.reshape(-1) for layer in self.owned()
                     for t in compute_inverse(self.inverse, *self._factors[layer.index],
                                              self.damping)]
            send = torch.cat(parts) if parts else self._empty()
        with self._timers.phase("communication"):
            pieces = ctx.run(allgather_v, send, ctx.group)
        self._note_exchange(send)
        self._inverses = {}
        for rank, piece in enumerate(pieces):
            layers = self.owned_by(rank)
            shapes = [inverse_shapes(self.inverse, ly.d_in, ly.d_out) for ly in layers]
            for layer, inverse in zip(layers, views(piece, shapes)):
                self._inverses[layer.index] = inverse

    def _preconditioned(self, ctx: Context) -> list[Result]:
        results = []
        with self._timers.phase("precondition"):
            for layer in self._layers:
                g = layer.grad_matrix()
                inverse = self._inverses.get(layer.index)
                v = precondition(self.inverse, inverse, g, self.damping) if inverse else g
                results.append((layer, v, g if self.kl_clip is not None else None))
        return results

    def _empty(self) -> torch.Tensor:
        w = self._layers[0].module.weight if self._layers else torch.empty(0)
        return torch.empty(0, dtype=w.dtype, device=w.device)


def _placeholder(like: torch.Tensor, n: int) -> torch.Tensor:
    """A memory-less ``(n, n)`` tensor with ``like``'s dtype and device: buckets only read
    shapes, dtypes and devices from it."""
    return torch.zeros((), dtype=like.dtype, device=like.device).expand(n, n)
