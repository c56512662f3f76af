"""The completeness check: every public name of ``commlib_public_modules`` is in the API
reference.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any

from sphinx.util import logging

logger = logging.getLogger(__name__)


def public_names(module: Any) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    out = []
    for name, obj in vars(module).items():
        if name.startswith("_"):
            continue
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and \
                getattr(obj, "__module__", None) == module.__name__:
            out.append(name)
    return out


def _resolve(fullname: str) -> Any:
    parts = fullname.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except Exception:
            return None
        return obj
    return None


def check_reference(app: Any, env: Any) -> None:
    domain = env.get_domain("py")
    documented = set(domain.objects)
    by_id: set[int] = set()
    for fullname in documented:
        obj = _resolve(fullname)
        if inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj):
            by_id.add(id(obj))
    missing = []
    for modname in app.config.commlib_public_modules:
        module = importlib.import_module(modname)
        if modname not in documented:
            missing.append(modname)
        for name in public_names(module):
            full = f"{modname}.{name}"
            if full in documented:
                continue
            obj = getattr(module, name, None)
            if (inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj)) \
                    and id(obj) in by_id:
                continue
            missing.append(full)
    for full in missing:
        logger.warning("public name %s is missing from the API reference (docs/reference)",
                       full, type="commlib", subtype="reference")
