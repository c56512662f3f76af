"""Registration point of ``dp_kfac`` (implementation: :mod:`commlib.algorithms.kfac.dp_kfac`)."""
from .kfac.dp_kfac import DPKFAC
from .registry import register

register("dp_kfac")(DPKFAC)

__all__ = ["DPKFAC"]
