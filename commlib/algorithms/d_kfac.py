"""Registration point of ``d_kfac`` (implementation: :mod:`commlib.algorithms.kfac.d_kfac`)."""
from .kfac.d_kfac import DKFAC
from .registry import register

register("d_kfac")(DKFAC)

__all__ = ["DKFAC"]
