"""The algorithm registry: built-in algorithms, decorated user classes and third-party
packages that declare an entry point in the group ``commlib.algorithms``:

.. code-block:: toml

    # not run: the pyproject.toml of a third-party package, not code
    [project.entry-points."commlib.algorithms"]
    my_algo = "my_package.module:MyAlgorithm"

Names are unique: registering a taken name is an error, whoever registers it.
"""
from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from importlib.metadata import entry_points
from typing import Any, TypeVar

ENTRY_POINT_GROUP = "commlib.algorithms"
_registry: dict[str, type] = {}
_entry_points_loaded = False
_BUILTINS = ("gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized",
             "qadam", "local_sgd", "async_model_average", "d_kfac", "dp_kfac", "diloco",
             "streaming_diloco", "powersgd", "sparseloco", "demo", "muloco")

T = TypeVar("T", bound=type)


def register(name: str) -> Callable[[T], T]:
    """Class decorator: make ``cls`` available as ``commlib.algorithms.get(name)``."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"commlib.algorithms.register: name must be an identifier, got {name!r}")

    def decorate(cls: T) -> T:
        _add(name, cls, origin=f"{cls.__module__}.{cls.__qualname__}")
        return cls

    return decorate


def _add(name: str, cls: type, origin: str) -> None:
    from .base import Algorithm
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise TypeError(f"commlib.algorithms.register({name!r}): {origin} is not a subclass of "
                        f"commlib.algorithms.Algorithm")
    taken = _registry.get(name)
    if taken is not None and taken is not cls:
        raise ValueError(f"commlib.algorithms.register: the name {name!r} is taken by "
                         f"{taken.__module__}.{taken.__qualname__}; choose another name")
    _registry[name] = cls
    cls.name = name


def _load_builtins() -> None:
    for module in _BUILTINS:
        import_module(f"{__package__}.{module}")


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _registry:
            continue
        _add(ep.name, ep.load(), origin=f"entry point {ep.value}")


def reload_entry_points() -> None:
    """Look for newly installed third-party algorithms (entry points are read once)."""
    global _entry_points_loaded
    _entry_points_loaded = False
    _load_entry_points()


def available() -> list[str]:
    """Names of every registered algorithm, built-in and third-party, sorted."""
    _load_builtins()
    _load_entry_points()
    return sorted(_registry)


def lookup(name: str) -> type:
    """The class registered as ``name`` (``ValueError`` naming the choices otherwise)."""
    names = available()
    if name not in _registry:
        raise ValueError(f"unknown commlib algorithm {name!r}; available: {', '.join(names)}")
    return _registry[name]


def get(name: str, **kwargs: Any) -> Any:
    """An instance of the algorithm registered as ``name``, configured with ``kwargs``."""
    return lookup(name)(**kwargs)
