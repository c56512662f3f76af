"""``.. commlib-mapping:: module.NAME``: a dict constant as a two-column table.
"""
from __future__ import annotations

import importlib

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util.docutils import SphinxDirective

from .rst import _list_table, _parse_rst


class MappingDirective(SphinxDirective):
    """``.. commlib-mapping:: module.NAME``: a dict constant as a two-column table, read
    when the site is built."""
    required_arguments = 1
    option_spec = {"header": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        modname, _, attr = self.arguments[0].rpartition(".")
        mapping = getattr(importlib.import_module(modname), attr)
        header = [h.strip() for h in self.options.get("header", "key, value").split(",", 1)]
        rows = [[f"``{k}``", str(v)] for k, v in mapping.items()]
        return _parse_rst(self, _list_table(header, rows, "25 75"))
