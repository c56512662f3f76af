"""Frameworks: PyTorch Lightning and Hugging Face Accelerate.

``import commlib`` calls :func:`install`, which imports neither framework: it arranges for
:mod:`.lightning` to register the ``"commlib"`` strategy when ``lightning.pytorch`` (or
``pytorch_lightning``) is imported, and for :mod:`.accelerate` to prepare Accelerate's
environment and patch it (the backend it records, averaging relaxed replicas before it
saves) when ``accelerate`` is imported (now, for a framework already imported), and for
the runner (:mod:`commlib.run`, which imports no integration) to prepare that environment
at start when it is imported.

* Lightning: ``Trainer(strategy="commlib")`` or
  ``Trainer(strategy=CommlibStrategy(algorithm="local_sgd", sync_every=4))``
  (:class:`commlib.integrations.lightning.CommlibStrategy`).
* Accelerate: ``init_process_group("commlib")`` before ``Accelerator()``, or nothing under
  ``python -m commlib`` (:mod:`commlib.integrations.accelerate`).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

# module name -> "submodule:function" of this package, called once that module is imported.
HOOKS = {
    "lightning.pytorch.strategies": "lightning:register_lightning",
    "pytorch_lightning.strategies": "lightning:register_pytorch_lightning",
    "accelerate": "accelerate:install",
    "commlib.run": "accelerate:prepare_with_runner",
}
_pending: dict[str, Callable[[], None]] = {}
_finding = threading.local()


def install() -> None:
    """Run each hook now if its module is imported, else right after it gets imported
    (idempotent; imports nothing)."""
    for name, target in HOOKS.items():
        if name in _pending:
            continue
        hook = _caller(target)
        if name in sys.modules:
            hook()
        else:
            _pending[name] = hook
    if _pending and not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())


def _caller(target: str) -> Callable[[], None]:
    module, function = target.split(":")

    def call() -> None:
        try:
            getattr(importlib.import_module(f"{__name__}.{module}"), function)()
        except Exception as exc:  # noqa: BLE001 - never break the user's import
            warnings.warn(f"commlib: the {module} integration could not be set up: {exc!r}",
                          stacklevel=2)

    return call


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module named in :data:`HOOKS`, finds it with the other
    finders and makes its loader run the hook after the module's code has run."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in _pending or getattr(_finding, "name", None) == name:
            return None
        _finding.name = name
        try:
            spec = importlib.util.find_spec(name)
        finally:
            _finding.name = None
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        hook = _pending.pop(name)
        exec_module = spec.loader.exec_module

        def exec_then_hook(module: Any) -> None:
            exec_module(module)
            hook()

        spec.loader.exec_module = exec_then_hook  # this spec's own loader object
        return spec

