"""Register the ``commlib`` torch.distributed backend once torch is imported, without
importing torch.

:func:`install` (called by ``import commlib``) registers at once when torch is already
imported, and otherwise puts a one-shot finder on ``sys.meta_path`` that registers right
after ``import torch`` finishes, so ``import commlib; import torch`` works as well as the
other order, and numpy-only users never load torch.

torch's own ``torch.backends`` entry-point autoload (device-backend autoload) also registers
the backend, for scripts that never import commlib: ``commlib_autoload`` (declared in
pyproject.toml) runs in every process that imports torch, so it imports nothing of commlib
and initializes no MPI; its creator imports commlib only when a commlib process group is
created. This hook covers the processes where autoload is off
(``TORCH_DEVICE_BACKEND_AUTOLOAD=0``) or the installed metadata predates the entry point.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any


def install() -> None:
    """Register now if torch is imported, else when it gets imported (idempotent)."""
    if "torch" in sys.modules:
        register_quietly()
    elif not any(isinstance(f, _TorchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchFinder())


def register_quietly() -> None:
    """Register the backend if torch.distributed is available; never break the import
    that triggered it (a failure becomes a warning)."""
    module = sys.modules.get("torch")
    if module is None or getattr(module, "distributed", None) is None:
        return
    try:
        if not module.distributed.is_available():
            return
        from .registration import register
        register()
    except Exception as exc:  # noqa: BLE001 - a warning, not a broken `import torch`
        warnings.warn(f"commlib: could not register the 'commlib' torch.distributed "
                      f"backend: {exc!r}", stacklevel=2)


class _TorchFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the first ``import torch`` it leaves ``sys.meta_path``,
    lets the other finders find torch, and makes the loader register the backend after
    torch's ``__init__`` has run."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            register_quietly()

        spec.loader.exec_module = exec_then_register  # this spec's own loader object
        return spec
