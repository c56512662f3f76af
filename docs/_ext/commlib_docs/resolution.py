"""References to commlib internals that Sphinx could not resolve.
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any


def _exists(fullname: str) -> bool:
    if not fullname.startswith("commlib"):
        return False
    parts = fullname.split(".")
    for i in range(len(parts), 0, -1):
        modname = ".".join(parts[:i])
        try:
            obj = importlib.import_module(modname)
        except Exception:
            continue
        for attr in parts[i:]:
            if attr in getattr(obj, "__dict__", {}) or attr in getattr(obj, "__all__", ()):
                obj = getattr(obj, attr, None)
            elif inspect.isclass(obj) and hasattr(obj, attr):
                obj = getattr(obj, attr)
            else:
                return False
        return True
    return False


def _loaded_names(target: str) -> bool:
    """Whether some loaded commlib module defines ``target`` (a bare name)."""
    for modname, module in list(sys.modules.items()):
        if modname.startswith("commlib") and module is not None and \
                target in getattr(module, "__dict__", {}):
            return True
    return False


def resolve_internal(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    """References Sphinx could not resolve, in commlib's docstrings.

    * A bare name (``:class:`Pipeline``` in a docstring shown under another module) links
      to the documented object of that name, searched as ``.Pipeline`` would be.
    * A reference to a commlib object that exists but is not in the reference (an internal
      module, a private helper class) is rendered as text, without a warning.
    * A reference to something that does not exist (a typo, a renamed function) keeps its
      warning: nitpicky mode still catches it.
    """
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip(".~")
    module = node.get("py:module") or ""
    cls = node.get("py:class") or ""
    domain = env.get_domain("py")
    typ = node.get("reftype")
    if "." not in target:
        objtypes = domain.objtypes_for_role(typ) or None
        matches = domain.find_obj(env, module, cls, target, None if typ == "obj" else
                                  (typ if objtypes else None), 1)
        matches = [m for m in matches if m[0].startswith("commlib")]
        if matches:
            matches.sort(key=lambda m: (-len(os.path.commonprefix([m[0], module])), m[0]))
            name, obj = matches[0]
            from sphinx.util.nodes import make_refnode
            return make_refnode(app.builder, node.get("refdoc", ""), obj.docname,
                                obj.node_id, contnode, name)
    candidates = [target]
    if module:
        candidates.append(f"{module}.{target}")
        if cls:
            candidates.append(f"{module}.{cls}.{target}")
        # a name relative to a parent package (``:mod:`openmpi``` inside commlib.mpi.mpi_impl)
        parts = module.split(".")
        for i in range(len(parts) - 1, 0, -1):
            candidates.append(".".join(parts[:i]) + "." + target)
    for name in candidates:
        if _exists(name):
            return contnode
    if "." not in target and module.startswith("commlib") and _loaded_names(target):
        return contnode
    return None
