"""Sphinx configuration of commlib's documentation site.

Build: ``sphinx-build -W -n --keep-going -b html docs docs/_build/html`` (what
``tests/test_docs.py`` runs, into a temporary directory). Warnings are errors and
references are nitpicky: every cross-reference must resolve.

Intersphinx (links into the Python, numpy, mpi4py and torch documentation) needs their
``objects.inv`` inventories, and our build machines cannot reach those sites. So the
inventories are committed in ``docs/_inventories`` (``python.inv``, ``numpy.inv``,
``mpi4py.inv``; where each comes from and its version: ``docs/_inventories/README.md``),
and a reference into Python, numpy or mpi4py is resolved and checked by nitpicky mode like
one to commlib: a wrong one fails the build. torch publishes its inventory only on its
website (its wheels and sdist carry no built documentation, and no Debian package ships
it), so ``torch.inv`` is not there: references into torch (and into the other namespaces
of ``_EXTERNAL`` below, which have no inventory either) stay plain text, and nitpicky mode
ignores them. A namespace whose inventory is missing from ``docs/_inventories`` is ignored
the same way; ``COMMLIB_DOCS_INTERSPHINX=1`` fetches every inventory online instead
(torch's included) where the network allows.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(ROOT / "benchmarks"))

project = "commlib"
author = "the commlib authors"
copyright = "2026, the commlib authors"
try:
    from importlib.metadata import version as _version
    release = _version("commlib")
except Exception:  # pragma: no cover - an uninstalled checkout
    release = "0.1.0"
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "myst_parser",
    "sphinx_copybutton",
    "commlib_docs",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_inventories", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# -- autodoc ------------------------------------------------------------------------------
autodoc_default_options = {"undoc-members": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_mock_imports: list[str] = []
napoleon_google_docstring = True
napoleon_numpy_docstring = True
add_module_names = False

# -- intersphinx (see the module docstring) -----------------------------------------------
_INVENTORIES = {
    "python": "https://docs.python.org/3.11",
    "numpy": "https://numpy.org/doc/stable",
    "torch": "https://pytorch.org/docs/stable",
    "mpi4py": "https://mpi4py.readthedocs.io/en/stable",
}
_online = os.environ.get("COMMLIB_DOCS_INTERSPHINX", "") == "1"
intersphinx_mapping = {}
for _name, _url in _INVENTORIES.items():
    _local = DOCS / "_inventories" / f"{_name}.inv"
    if _local.is_file():
        intersphinx_mapping[_name] = (_url, str(_local))
    elif _online:
        intersphinx_mapping[_name] = (_url, None)
intersphinx_timeout = 10

# -- nitpicky mode ------------------------------------------------------------------------
nitpicky = True
# Names outside commlib without an inventory: plain text, not a warning. A namespace whose
# inventory is loaded (above) is checked; commlib's own names are never ignored.
_NAMESPACES = {
    "python": r"concurrent|threading|collections|typing|types|os|pathlib|"
              r"argparse|enum|dataclasses|contextlib|warnings|socket|io|abc|importlib|"
              r"subprocess|queue|weakref|functools|datetime",
    "numpy": r"numpy|np",
    "mpi4py": r"mpi4py|MPI",
}
_EXTERNAL = r"torch|typing_extensions|cupy|lightning|pytorch_lightning|accelerate|numba|" \
            r"sklearn|horovod|nn|optim|F|Tensor|Module|Parameter|Optimizer|dist"
_ignored = [_EXTERNAL] + [names for project, names in _NAMESPACES.items()
                          if project not in intersphinx_mapping]
nitpick_ignore_regex = [
    (r"py:.*", r"(" + "|".join(_ignored) + r")(\..*)?"),
    (r"py:.*", r"c10d::.*"),          # torch's C++ names in its inherited docstrings
]

# -- HTML ---------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"commlib {release}"
html_static_path: list[str] = []
copybutton_prompt_text = r"\$ |>>> |\.\.\. "
copybutton_prompt_is_regexp = True

# -- commlib_docs (docs/_ext/commlib_docs/) ----------------------------------------------
# Every public name of these modules (their __all__, else their public attributes defined
# in them) must be documented in the reference, or the build fails.
commlib_public_modules = [
    "commlib", "commlib.algorithms", "commlib.ddp", "commlib.sharded", "commlib.embedding",
    "commlib.pipeline", "commlib.parallel", "commlib.torch_backend", "commlib.horovod",
    "commlib.elastic", "commlib.primitives", "commlib.nn", "commlib.ddp.comm_hooks",
    "commlib.services.timeline", "commlib.run", "commlib.services.topology",
    "commlib.mpi.mpi_impl", "commlib.mpi.launch", "commlib.kernels",
    "commlib.integrations", "commlib.integrations.lightning",
    "commlib.integrations.accelerate",
]
commlib_results_dir = str(ROOT / "benchmarks" / "results")
