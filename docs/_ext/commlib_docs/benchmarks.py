"""``.. commlib-benchmarks::``: a table per ``benchmarks/results/*.json`` file.
"""
from __future__ import annotations

import glob
import json
import os

from docutils import nodes
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

from .benchmark_summaries import _MADE_BY, _committed, _kind, _summarise
from .rst import _list_table, _parse_rst

logger = logging.getLogger(__name__)


class BenchmarksDirective(SphinxDirective):
    """Every ``*.json`` of the results folder, each under its own section title; or, with
    arguments (file names or patterns relative to the folder, e.g. ``tta_gpt_2x1/*.json``),
    only those, each under a rubric (usable inside a page's own sections, e.g. from a MyST
    page's ``{eval-rst}`` block)."""
    has_content = False
    optional_arguments = 1
    final_argument_whitespace = True

    def run(self) -> list[nodes.Node]:
        folder = self.config.commlib_results_dir
        text = ""
        generic = []
        patterns = self.arguments[0].split() if self.arguments else ["*.json"]
        paths = sorted({p for pattern in patterns
                        for p in glob.glob(os.path.join(folder, pattern))})
        if self.arguments and not paths:
            logger.warning("commlib-benchmarks: no result file matches %s", self.arguments[0],
                           location=self.get_location())
        for path in paths:
            self.env.note_dependency(path)
            name = os.path.basename(path)
            try:
                with open(path) as fh:
                    data = json.load(fh)
                body = _summarise(data)
            except Exception as exc:  # a malformed file: listed, not fatal
                data, body = None, None
                logger.info("commlib-benchmarks: %s: %s", name, exc)
            if body is None:
                keys = ", ".join(f"``{k}``" for k in data) if isinstance(data, dict) else \
                    type(data).__name__
                generic.append([f"``{name}``", keys])
                continue
            title = os.path.relpath(path, folder)
            text += (f".. rubric:: {title}\n\n" if self.arguments
                     else f"{title}\n{'-' * len(title)}\n\n")
            made = _MADE_BY.get(_kind(data) or "", "")
            when = _committed(path)
            meta = []
            if made:
                meta.append(f"made by ``{made}``")
            if when:
                meta.append(f"committed {when.split()[0]} (``{when.split()[-1]}``)")
            if meta:
                line = "; ".join(meta)
                text += line[0].upper() + line[1:] + ".\n\n"
            text += f"{body}\n"
            png = os.path.splitext(path)[0] + ".png"
            if os.path.exists(png):
                self.env.note_dependency(png)
                here = os.path.dirname(self.env.doc2path(self.env.docname))
                text += (f".. image:: {os.path.relpath(png, here)}\n   :width: 100%\n"
                         f"   :alt: the plot committed beside {name}\n\n")
        if generic:
            title = "Other result files"
            text += (f".. rubric:: {title}\n\n" if self.arguments
                     else f"{title}\n{'-' * len(title)}\n\n")
            text += _list_table(["file", "top-level keys"], generic)
        return _parse_rst(self, text)
