"""``.. commlib-options::``: the table of :data:`commlib.options` and the runner's and the
launcher's variables.
"""
from __future__ import annotations

import importlib

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

from .rst import _list_table, _parse_rst


class OptionsDirective(SphinxDirective):
    has_content = False

    def run(self) -> list[nodes.Node]:
        options_module = importlib.import_module("commlib.base.options")
        environment = importlib.import_module("commlib.mpi.launch.environment")
        self.env.note_dependency(options_module.__file__)
        rows = []
        for name, (_parse, default, var, doc) in options_module._FIELDS.items():
            rows.append([f"``{name}``", f"``{var}``", f"``{default!r}``", doc])
        text = _list_table(["option", "environment variable", "default", "meaning"], rows,
                           "12 20 8 60")
        text += ("\nRead by the runner (``python -m commlib``, :class:`commlib.run.Config`), "
                 "not by :data:`commlib.options`: "
                 + ", ".join(f"``{v}``" for v in options_module.RUNNER_VARIABLES) + ".\n")
        text += ("\nRead by the launch layer before MPI starts (:mod:`commlib.mpi.launch`): "
                 + ", ".join(f"``{v}``" for v in environment.VARIABLES) + ".\n")
        return _parse_rst(self, text)
