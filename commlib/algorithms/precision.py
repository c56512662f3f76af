"""Exchange precision of gradient-averaging algorithms: ``comm_dtype`` and
``predivide_factor``, with Horovod's semantics.

.. not run: pseudocode of the algorithm's step

A bucket of gradients ``g`` (any floating dtype) is averaged over ``n`` ranks as::

    send = (g / f)  cast to comm_dtype       # before the sum (f = predivide_factor)
    send = SUM over ranks of send            # in comm_dtype (bf16/fp16 combined in fp32)
    g    = send cast back to g's dtype / (n / f)

so the result is ``sum(g / f) * f / n``. ``f = 1`` divides after the sum (the library's
default), ``f = n`` before it (torch DDP's and its ``fp16_compress_hook``'s choice); in
float16 a large ``f`` underflows small gradients and ``f = 1`` overflows large sums of many
ranks, so a value in between (e.g. ``sqrt(n)``) keeps both in range. The division before
the sum happens in the gradient's dtype (before the cast), the one after it in the
gradient's dtype (after the cast back). ``comm_dtype=None`` exchanges in the gradient's
own dtype; ``torch.float16``/``torch.bfloat16`` halve the bytes of float32 gradients.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "float64": torch.float64, "fp64": torch.float64, "double": torch.float64}


def check(algorithm: str, comm_dtype: Any, predivide_factor: Any,
          average: bool = True) -> tuple[torch.dtype | None, float]:
    """Validated ``(comm_dtype, predivide_factor)`` of an algorithm's constructor.

    ``comm_dtype``: ``None``, a floating ``torch.dtype`` or its name (``"bf16"``,
    ``"float16"``, ...); ``predivide_factor``: a positive finite number (only with
    averaging). ``TypeError``/``ValueError`` name the argument and the algorithm."""
    if isinstance(comm_dtype, str):
        comm_dtype = comm_dtype.removeprefix("torch.")
        if comm_dtype.lower() not in _DTYPES:
            raise ValueError(f"{algorithm}: argument 'comm_dtype' must be None, a floating "
                             f"torch.dtype or one of {sorted(_DTYPES)}, got {comm_dtype!r}")
        comm_dtype = _DTYPES[comm_dtype.lower()]
    if comm_dtype is not None and not (isinstance(comm_dtype, torch.dtype)
                                       and comm_dtype.is_floating_point):
        raise TypeError(f"{algorithm}: argument 'comm_dtype' must be None or a floating "
                        f"torch.dtype, got {comm_dtype!r}")
    if isinstance(predivide_factor, bool) or not isinstance(predivide_factor, (int, float)):
        raise TypeError(f"{algorithm}: argument 'predivide_factor' must be a number, got "
                        f"{type(predivide_factor).__name__}")
    factor = float(predivide_factor)
    if not (factor > 0 and factor != float("inf")):
        raise ValueError(f"{algorithm}: argument 'predivide_factor' must be positive and "
                         f"finite, got {predivide_factor!r}")
    if factor != 1.0 and not average:
        raise ValueError(f"{algorithm}: argument 'predivide_factor' ({factor}) divides an "
                         f"average; it needs average=True")
    return comm_dtype, factor


def is_plain(flat: torch.Tensor, comm_dtype: torch.dtype | None, factor: float) -> bool:
    """True when the exchange is the plain one (own dtype, division after the sum)."""
    return (comm_dtype is None or comm_dtype == flat.dtype) and factor == 1.0


def prepare(flat: torch.Tensor, comm_dtype: torch.dtype | None, factor: float,
            divide: bool = True) -> torch.Tensor:
    """What this rank sends: ``flat / f`` in ``comm_dtype`` (``flat`` itself, divided in
    place, when no cast is needed; a new tensor otherwise)."""
    scale = divide and factor != 1.0
    with torch.no_grad():
        if comm_dtype is not None and comm_dtype != flat.dtype:
            return (flat / factor if scale else flat).to(comm_dtype)
        return flat.div_(factor) if scale else flat


def finish(flat: torch.Tensor, summed: torch.Tensor, n: int, factor: float,
           divide: bool = True) -> torch.Tensor:
    """``flat`` <- ``summed`` (the sum over ranks of what :func:`prepare` returned) cast
    back to ``flat``'s dtype and divided by ``n / f``, in place. Returns ``flat``."""
    with torch.no_grad():
        if summed is not flat:
            flat.copy_(summed)
        if divide:
            flat.div_(n / factor)
    return flat


def average(flat: torch.Tensor, n: int, comm_dtype: torch.dtype | None, factor: float,
            sum_: Callable[[torch.Tensor], Any], divide: bool = True) -> torch.Tensor:
    """Replace ``flat`` (1-D, floating, in place) by ``sum(flat / f) * f / n`` over the
    ``n`` ranks, exchanged in ``comm_dtype``: :func:`prepare`, ``sum_(t)`` (sums ``t`` over
    the ranks in place, blocking), :func:`finish`. ``divide=False`` skips every division
    (a plain sum in ``comm_dtype``). Returns ``flat``."""
    send = prepare(flat, comm_dtype, factor, divide)
    sum_(send)
    return finish(flat, send, n, factor, divide)
