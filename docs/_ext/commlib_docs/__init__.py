"""Sphinx extension of commlib's documentation: pages generated from the code and the
results at build time, and the check that the API reference is complete.

Directives (their output is built when the site is, so it cannot drift from the code):

``.. commlib-options::``
    the table of :data:`commlib.options` (name, environment variable, default, meaning),
    read from ``commlib.base.options._FIELDS``, plus the runner's and the launcher's variables.
``.. commlib-cli:: MODULE``
    ``python -m MODULE --help``, run at build time.
``.. commlib-benchmarks::``
    a table per ``benchmarks/results/*.json`` file (``commlib_results_dir``).
``.. commlib-algorithm:: NAME`` (also in Markdown pages)
    the registered class of a DDP algorithm and its knobs (its ``__init__`` signature).
``.. commlib-algorithm-classes::``
    ``autoclass`` of every registered built-in algorithm.

The check: after every page is read, each public name of the modules listed in
``commlib_public_modules`` (their ``__all__``, else the public classes and functions they
define) must be described somewhere in the reference (as itself, or, for a re-exported
class or function, the same object under another public name); a missing one is a
warning, so ``sphinx-build -W`` fails.

Docstring code blocks: every code block of a docstring autodoc renders must be runnable
or marked not runnable (``docstring_blocks.py``; an unmarked one is a warning);
the blocks are recorded in ``commlib_docstring_blocks.json`` in the doctree directory,
which ``tests/test_docs.py`` compares with the blocks ``tests/test_docstring_examples.py``
runs.

Modules, one concept each: ``rst`` (generated reStructuredText), ``options``, ``cli``,
``benchmarks`` and ``benchmark_summaries``, ``algorithms``, ``mapping`` (the directives),
``reference`` (the completeness check), ``resolution`` (references to commlib internals),
``autodoc_fixes`` (docstring handlers), ``docstring_blocks`` (the parser, no Sphinx
import: the tests load it alone) and ``docstring_examples`` (the build's check of them).
"""
from __future__ import annotations

from typing import Any

from .algorithms import AlgorithmClassesDirective, AlgorithmDirective
from .autodoc_fixes import drop_type_docstrings, restore_prose
from .benchmarks import BenchmarksDirective
from .cli import CliDirective
from .docstring_examples import (
    _merge_docstring_blocks,
    _purge_docstring_blocks,
    check_docstring_blocks,
    write_docstring_blocks,
)
from .mapping import MappingDirective
from .options import OptionsDirective
from .reference import check_reference
from .resolution import resolve_internal


def setup(app: Any) -> dict[str, Any]:
    app.connect("autodoc-process-docstring", drop_type_docstrings)
    app.add_directive("commlib-mapping", MappingDirective)
    app.connect("missing-reference", resolve_internal)
    app.connect("autodoc-process-docstring", restore_prose, priority=600)
    app.add_config_value("commlib_public_modules", [], "env")
    app.add_config_value("commlib_results_dir", "", "env")
    app.add_directive("commlib-options", OptionsDirective)
    app.add_directive("commlib-cli", CliDirective)
    app.add_directive("commlib-benchmarks", BenchmarksDirective)
    app.add_directive("commlib-algorithm", AlgorithmDirective)
    app.add_directive("commlib-algorithm-classes", AlgorithmClassesDirective)
    app.connect("env-check-consistency", check_reference)
    app.connect("autodoc-process-docstring", check_docstring_blocks, priority=700)
    app.connect("env-purge-doc", _purge_docstring_blocks)
    app.connect("env-merge-info", _merge_docstring_blocks)
    app.connect("build-finished", write_docstring_blocks)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
