"""``autodoc-process-docstring`` handlers: prose napoleon read as a type put back, built-in
types' docstrings dropped from constants.
"""
from __future__ import annotations

import re
from typing import Any

_TYPE_RE = re.compile(r"[\w.\[\]|,~`:]+")


def restore_prose(app: Any, what: str, name: str, obj: Any, options: Any,
                  lines: list[str]) -> None:
    """Napoleon reads ``text: more`` on an attribute's or property's first line as a type
    and its description (``:type: text``); commlib's docstrings are prose, so where the
    "type" is not one (``Whether the replicas may differ now: ...``) the line is put back
    as it was. Runs after napoleon."""
    if what not in ("attribute", "property", "data"):
        return
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(":type: "):
            kind = lines[i][len(":type: "):].strip()
            if _TYPE_RE.fullmatch(kind.replace(" | ", "|").replace(", ", ",")):
                return
            del lines[i]
            if i > 0 and not lines[i - 1].strip():
                del lines[i - 1]
            for j, line in enumerate(lines):
                if line.strip():
                    indent = line[:len(line) - len(line.lstrip())]
                    lines[j] = f"{indent}{kind}: {line.lstrip()}"
                    break
            return


_BUILTIN_VALUES = (str, bytes, int, float, bool, tuple, list, dict, set, frozenset)


def drop_type_docstrings(app: Any, what: str, name: str, obj: Any, options: Any,
                         lines: list[str]) -> None:
    """A module constant of a built-in type (``GRADIENTS = "gradients"``) has no docstring
    of its own: autodoc would show ``str``'s or ``dict``'s. The page says what it is."""
    if what in ("data", "attribute") and type(obj) in _BUILTIN_VALUES and \
            lines and (type(obj).__doc__ or "").strip().startswith(lines[0].strip()):
        lines[:] = []
