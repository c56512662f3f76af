"""``.. commlib-cli:: MODULE``: ``python -m MODULE --help``, run at build time.
"""
from __future__ import annotations

import os
import subprocess
import sys

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)


class CliDirective(SphinxDirective):
    required_arguments = 1
    option_spec = {"args": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        module = self.arguments[0]
        args = self.options.get("args", "--help").split()
        env = {**os.environ, "COMMLIB_TORCH_ENV": "0", "COLUMNS": "90"}
        env.pop("COMMLIB_CHECK", None)
        cmd = [sys.executable, "-m", module, *args]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        except subprocess.TimeoutExpired:
            logger.warning("commlib-cli: %s timed out", " ".join(cmd), location=self.get_location())
            return []
        text = done.stdout.strip() or done.stderr.strip()
        if done.returncode != 0:
            logger.warning("commlib-cli: %s exited with %d: %s", " ".join(cmd), done.returncode,
                           done.stderr.strip()[-500:], location=self.get_location())
        shown = f"$ python -m {module} {' '.join(args)}\n{text}"
        block = nodes.literal_block(shown, shown)
        block["language"] = "text"
        return [block]
