"""``hvd.elastic``: Horovod's elastic training is to map onto commlib's fault-tolerant
training (issue 21, "survive a dead rank"), which has not landed yet; every entry point
raises ``NotImplementedError`` saying so."""
from __future__ import annotations

from typing import Any

_MESSAGE = ("commlib.horovod.elastic.{}: Horovod's elastic training needs commlib's "
            "fault-tolerant training (issue 21, 'survive a dead rank': commlib.elastic), which "
            "is not available yet; run without elastic (a fixed set of ranks)")


def run(func: Any) -> Any:
    """``@hvd.elastic.run``: not available (see the module docstring)."""
    raise NotImplementedError(_MESSAGE.format("run"))


class _Unavailable:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(_MESSAGE.format(type(self).__name__))


class State(_Unavailable):
    pass


class ObjectState(_Unavailable):
    pass


class TorchState(_Unavailable):
    pass


class ElasticSampler(_Unavailable):
    pass
