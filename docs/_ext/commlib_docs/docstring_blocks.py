"""The code blocks of a docstring, as the API reference renders them, with their markers.

Shared by the site's extension (``commlib_docs``: a docstring block on the site without a
marker fails the build) and by ``tests/test_docstring_examples.py`` (which runs them). No
Sphinx import: the tests load this file without the docs extra.

A code block of a (cleaned, :func:`inspect.cleandoc`) docstring is one of

* a literal block: the indented lines after a paragraph that ends in ``::`` (``Example::``,
  ``... the outer step::``, a lone ``::``); Python unless a marker says otherwise;
* a ``.. code-block:: LANG`` (``.. code::``, ``.. sourcecode::``) directive's content;
* a doctest block: a paragraph whose first line starts with ``>>>``.

Markers, as on the site's pages (``tests/test_docs.py``): the block's first line is
``# run: mpiexec -n 2`` (``>>> # run: ...`` in a doctest), ``# run: bash`` (a shell block)
or ``# not run: REASON``; where a first-line comment does not fit (a diagram, a formula),
a reST comment ``.. not run: REASON`` on the lines just above the paragraph that opens the
block (or above the directive) says the same and is not rendered.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

PYTHON = ("python", "py", "python3", "pycon", "default")
SHELL = ("bash", "sh", "shell", "console")

_RUN = re.compile(r"^(?:>>>\s*)?#\s*run:\s*(?P<how>.+)$")
_NOT_RUN = re.compile(r"^(?:>>>\s*)?#\s*not run:\s*(?P<why>.+)$")
_REST_NOT_RUN = re.compile(r"^\s*\.\.\s+not run:\s*(?P<why>.+?)\s*$")
_DIRECTIVE = re.compile(r"^\.\.\s+(?:code-block|code|sourcecode)::\s*(?P<lang>\S*)\s*$")


@dataclass
class DocBlock:
    obj: str                      # the documented object's full name
    line: int                     # first line of the block's content in the docstring (1-based)
    code: str
    lang: str = "python"
    doctest: bool = False
    launch: str | None = None     # the text after "# run:", None: one process
    not_run: str | None = None    # the reason, when not runnable here

    @property
    def id(self) -> str:
        return f"{self.obj}:{self.line}"

    @property
    def runs(self) -> bool:
        if self.not_run is not None:
            return False
        return self.lang in PYTHON or (self.lang in SHELL and self.launch == "bash")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _comment_reason(lines: list[str], start: int) -> str | None:
    """The reason of a ``.. not run:`` comment among the lines just above line ``start``
    (blank lines between them allowed)."""
    i = start - 1
    while i >= 0 and not lines[i].strip():
        i -= 1
    if i >= 0 and (m := _REST_NOT_RUN.match(lines[i])):
        return m["why"]
    return None


def _paragraph_start(lines: list[str], i: int) -> int:
    while i > 0 and lines[i - 1].strip():
        i -= 1
    return i


def _body(lines: list[str], j: int, indent: int) -> tuple[list[str], int]:
    """The lines of an indented block starting at ``j`` (after blank lines) and more
    indented than ``indent``, dedented; and the index after it."""
    n = len(lines)
    while j < n and not lines[j].strip():
        j += 1
    if j >= n or _indent(lines[j]) <= indent:
        return [], j
    body_start = j
    while j < n and (not lines[j].strip() or _indent(lines[j]) > indent):
        j += 1
    body = lines[body_start:j]
    while body and not body[-1].strip():
        body.pop()
    cut = min(_indent(b) for b in body if b.strip())
    return [b[cut:] for b in body], body_start


def _marked(block: DocBlock, first: str, reason: str | None) -> DocBlock:
    if (mr := _RUN.match(first.strip())):
        block.launch = mr["how"].strip()
    elif (mn := _NOT_RUN.match(first.strip())):
        block.not_run = mn["why"].strip()
    elif reason is not None:
        block.not_run = reason
    return block


def parse_docstring(doc: str | None, obj: str) -> list[DocBlock]:
    """The code blocks of docstring ``doc`` (already cleaned) of object ``obj``."""
    if not doc:
        return []
    lines = doc.expandtabs().splitlines()
    out: list[DocBlock] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        text = line.strip()
        indent = _indent(line)
        if text.startswith(">>>") and (i == 0 or not lines[i - 1].strip()):
            j = i
            while j < len(lines) and lines[j].strip():
                j += 1
            body = [b[indent:] for b in lines[i:j]]
            block = DocBlock(obj, i + 1, "\n".join(body) + "\n", lang="pycon", doctest=True)
            out.append(_marked(block, body[0], _comment_reason(lines, i)))
            i = j
            continue
        directive = _DIRECTIVE.match(text)
        if directive or (text.endswith("::") and not text.startswith("..")):
            j = i + 1
            if directive:
                while j < len(lines) and lines[j].strip().startswith(":") and \
                        _indent(lines[j]) > indent:
                    j += 1                                  # the directive's options
                lang, opener = directive["lang"] or "python", i
            else:
                lang, opener = "python", _paragraph_start(lines, i)
            body, start = _body(lines, j, indent)
            if body:
                block = DocBlock(obj, start + 1, "\n".join(body) + "\n", lang=lang)
                out.append(_marked(block, body[0], _comment_reason(lines, opener)))
                end = start + len(body)
                i = end
                continue
        i += 1
    return out


def object_blocks(obj: object, name: str) -> list[DocBlock]:
    """The code blocks of ``obj``'s docstring as autodoc shows it (inherited included)."""
    try:
        doc = inspect.getdoc(obj)
    except Exception:
        return []
    return parse_docstring(doc, name)
