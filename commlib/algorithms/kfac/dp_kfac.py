"""``dp_kfac``: data-parallel K-FAC with distributed preconditioning.

Per step: gradients are averaged (allreduce, as ``gradient_allreduce``). Each layer's owner,
and only the owner, builds that layer's factors from its own local batch, inverts them and
preconditions the averaged gradient; the preconditioned gradients of all layers are then
shared in one ``allgather_v`` and every rank (owners included) copies them from the gathered
buffer into ``p.grad``, so every rank uses the owner's bits. No factor or inverse ever
travels, and a rank holds factors and inverses of its own layers only.

Why ``allgather_v`` rather than an allreduce of a zero-filled buffer where only owners
write: each rank hands MPI just its owned layers' ``d_out * d_in`` elements, so summed over
ranks the bytes are ``sum(d_in * d_out)`` once (bus bytes ``(n - 1) *`` that), where the
allreduce would hand every rank the whole buffer (``n`` times the bytes, ``2 (n - 1)`` times on
the bus) and add zeros. ``allgather_v`` adds a 16-byte shape exchange per step.
"""
from __future__ import annotations

import torch

from ...primitives import allgather_v
from ...primitives.finite import all_finite
from .. import state
from ..base import Context
from .core import KFAC, Result
from .factors import update_running
from .inverses import compute_inverse, precondition
from .layers import KFACLayer
from .packing import views


class DPKFAC(KFAC):
    """Data-parallel K-FAC (see the module docstring and :class:`KFAC` for the
    hyperparameters). The factors are those of the owner's local batch, not of the global
    batch: with shards of different statistics the preconditioner differs from d_kfac's.
    Its state holds the owned layers only, so it is loaded by the rank that saved it."""

    per_rank_state = True

    def _captured_layers(self) -> list[KFACLayer]:
        return self.owned()

    def _allocate(self, ctx: Context) -> None:
        self._factors: dict[int, list[torch.Tensor]] = {}
        self._inverses: dict[int, list[torch.Tensor]] = {}
        owned = self.owned()
        like = self._layers[0].module.weight if self._layers else torch.empty(0)
        self._send = torch.zeros(sum(ly.grad_numel for ly in owned), dtype=like.dtype,
                                 device=like.device)
        self._send_views = [v for v, in views(self._send, [[(ly.d_out, ly.d_in)] for ly in owned])]

    def _factor_items(self) -> list[tuple[int, tuple[torch.Tensor, torch.Tensor]]]:
        return [(i, tuple(ag)) for i, ag in self._factors.items()]

    def _inverse_items(self) -> list[tuple[int, list[torch.Tensor]]]:
        return list(self._inverses.items())

    def _load_factors(self, factors: dict[int, list[torch.Tensor]]) -> None:
        device = self._send.device
        self._factors = {i: [state.restore(t, device) for t in ag] for i, ag in factors.items()}

    def _update_factors(self, ctx: Context, first: bool) -> None:
        """Owned layers only, from this rank's batch. ``first`` is not needed: a layer's first
        factors (whenever they come) are taken as they are. A layer that missed this step,
        or whose batch factors overflowed, keeps its factors."""
        with self._timers.phase("factors"):
            for layer in self.owned():
                a = self._capture.batch_factor(layer, "A")
                g = self._capture.batch_factor(layer, "G")
                if a is None or g is None or not (all_finite(a) and all_finite(g)):
                    continue
                held = self._factors.get(layer.index)
                if held is None:
                    self._factors[layer.index] = [a, g]
                else:
                    update_running(held[0], a, self.factor_decay, first=False)
                    update_running(held[1], g, self.factor_decay, first=False)

    def _update_inverses(self, ctx: Context) -> None:
        """Invert the owned layers that have factors; nothing is communicated."""
        with self._timers.phase("inverses"):
            for index, (a, g) in self._factors.items():
                self._inverses[index] = compute_inverse(self.inverse, a, g, self.damping)

    def _preconditioned(self, ctx: Context) -> list[Result]:
        """Owners precondition into the send buffer; one allgather_v; everyone reads every
        layer's result from the gathered buffer."""
        with self._timers.phase("precondition"):
            for layer, out in zip(self.owned(), self._send_views):
                g = layer.grad_matrix()
                inverse = self._inverses.get(layer.index)
                out.copy_(precondition(self.inverse, inverse, g, self.damping) if inverse else g)
        with self._timers.phase("communication"):
            pieces = ctx.run(allgather_v, self._send, ctx.group)
        self._note_exchange(self._send, pieces[0])
        results = []
        for rank, piece in enumerate(pieces):
            layers = self.owned_by(rank)
            for layer, (v,) in zip(layers, views(piece, [[(ly.d_out, ly.d_in)] for ly in layers])):
                results.append((layer, v, self._plain(layer)))
        results.sort(key=lambda r: r[0].index)
        return results
