"""Saving and restoring the state of a K-FAC algorithm (:class:`.core.KFAC`): what
:meth:`~commlib.algorithms.Algorithm.state_dict` holds besides the iteration count."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import state
from . import inverses

# ``algo`` below is a :class:`.core.KFAC`; core imports this module, never the reverse.
KFAC = Any


def save(algo: KFAC) -> dict[str, Any]:
    """The layers and owners (checked on load), the number of factor updates, and the
    running factors and the inverses this rank holds, by layer name."""
    return {"layers": [[ly.name, ly.d_in, ly.d_out] for ly in algo._layers],
            "owners": list(algo._owners), "inverse": algo.inverse,
            "factor_updates": algo._factor_updates,
            "factors": {name: list(ag) for name, ag in algo.held_factors().items()},
            "inverses": {name: list(inv) for name, inv in algo.held_inverses().items()}}


def load(algo: KFAC, saved: Mapping[str, Any], where: str) -> None:
    """Check ``saved`` (a :func:`save` of the same algorithm, model and world size; else
    ``ValueError`` naming what differs), then restore factors, inverses and counters."""
    state.check_keys(where, saved, ("layers", "owners", "inverse", "factor_updates",
                                    "factors", "inverses"))
    state.check_same(where, "the K-FAC layers (name, d_in, d_out)",
                     [list(ly) for ly in saved["layers"]],
                     [[ly.name, ly.d_in, ly.d_out] for ly in algo._layers])
    state.check_same(where, "the owners of the layers", list(saved["owners"]),
                     list(algo._owners))
    state.check_same(where, "inverse", saved["inverse"], algo.inverse)
    by_name = {ly.name: ly for ly in algo._layers}
    mine = {ly.name for ly in algo._captured_layers()}
    dtype = algo._layers[0].module.weight.dtype if algo._layers else None
    if algo.holds_every_factor:
        state.check_same(where, "the layers whose factors are held",
                         sorted(saved["factors"]), sorted(mine))
    for name, ag in saved["factors"].items():
        if name not in mine:
            raise ValueError(f"{where}: the saved state holds factors of layer {name!r}, "
                             f"which this rank does not keep")
        layer = by_name[name]
        state.check_tensor(where, f"factor A of {name!r}", ag[0], (layer.d_in,) * 2, dtype)
        state.check_tensor(where, f"factor G of {name!r}", ag[1], (layer.d_out,) * 2, dtype)
    for name, inv in saved["inverses"].items():
        layer = by_name.get(name)
        if layer is None:
            raise ValueError(f"{where}: the saved state holds the inverse of unknown "
                             f"layer {name!r}")
        shapes = inverses.inverse_shapes(algo.inverse, layer.d_in, layer.d_out)
        if len(inv) != len(shapes):
            raise ValueError(f"{where}: the inverse of {name!r} has {len(inv)} tensors, "
                             f"expected {len(shapes)}")
        for j, (t, shape) in enumerate(zip(inv, shapes)):
            state.check_tensor(where, f"inverse tensor {j} of {name!r}", t, shape, dtype)
    device = algo._layers[0].module.weight.device if algo._layers else None
    algo._load_factors({by_name[n].index: ag for n, ag in saved["factors"].items()})
    algo._inverses = {by_name[n].index: [state.restore(t, device) for t in inv]
                      for n, inv in saved["inverses"].items()}
    algo._factor_updates = int(saved["factor_updates"])
