"""Generated reStructuredText: parsing it in a directive, list tables.
"""
from __future__ import annotations

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles


def _parse_rst(directive: SphinxDirective, text: str) -> list[nodes.Node]:
    """Parse generated reStructuredText (only used from .rst pages)."""
    container = nodes.section()
    container.document = directive.state.document
    lines = StringList(text.splitlines(), source=f"<{directive.name}>")
    nested_parse_with_titles(directive.state, lines, container, directive.content_offset)
    return container.children


def _cell(text: str) -> str:
    return " ".join(str(text).split())


def _list_table(header: list[str], rows: list[list[str]], widths: str | None = None) -> str:
    out = [".. list-table::", "   :header-rows: 1"]
    if widths:
        out.append(f"   :widths: {widths}")
    out.append("")
    for row in [header, *rows]:
        for i, cell in enumerate(row):
            out.append(("   * - " if i == 0 else "     - ") + (_cell(cell) or "\\-"))
    out.append("")
    return "\n".join(out)
