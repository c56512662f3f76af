"""The code blocks of the docstrings the reference renders: checked for a marker, recorded
for the tests.
"""
from __future__ import annotations

import json
import os
from typing import Any

from sphinx.util import logging

from .docstring_blocks import parse_docstring

logger = logging.getLogger(__name__)


def check_docstring_blocks(app: Any, what: str, name: str, obj: Any, options: Any,
                           lines: list[str]) -> None:
    """Record every code block of a docstring autodoc renders, and warn (an error under
    ``-W``) about one that is neither runnable nor marked not runnable
    (``docs/_ext/commlib_docs/docstring_blocks.py``; ``tests/test_docstring_examples.py`` runs
    them). Runs last, on the lines the page shows."""
    env = app.env
    store = env.__dict__.setdefault("commlib_docstring_blocks", {})
    for block in parse_docstring("\n".join(lines), name):
        store.setdefault(env.docname, []).append(
            {"obj": name, "line": block.line, "lang": block.lang, "code": block.code,
             "runs": block.runs, "not_run": block.not_run})
        if block.not_run is None and not block.runs:
            logger.warning("a %s code block in the docstring of %s (its line %d) is neither "
                           "run nor marked: start it with '# run: ...' or '# not run: "
                           "REASON'", block.lang, name, block.line,
                           location=env.docname, type="commlib", subtype="docstring")


def _purge_docstring_blocks(app: Any, env: Any, docname: str) -> None:
    env.__dict__.get("commlib_docstring_blocks", {}).pop(docname, None)


def _merge_docstring_blocks(app: Any, env: Any, docnames: Any, other: Any) -> None:
    store = env.__dict__.setdefault("commlib_docstring_blocks", {})
    for docname, blocks in other.__dict__.get("commlib_docstring_blocks", {}).items():
        if docname in docnames:
            store[docname] = blocks


def write_docstring_blocks(app: Any, exception: Any) -> None:
    """``commlib_docstring_blocks.json`` in the doctree directory: the docstring code blocks
    the site shows (what ``tests/test_docs.py`` compares with the blocks it runs)."""
    if exception is not None:
        return
    store = app.env.__dict__.get("commlib_docstring_blocks", {})
    out = [dict(block, docname=docname) for docname in sorted(store)
           for block in store[docname]]
    with open(os.path.join(app.doctreedir, "commlib_docstring_blocks.json"), "w") as fh:
        json.dump(out, fh, indent=1)
