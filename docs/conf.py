"""Sphinx configuration of commlib's documentation site.

Build: ``sphinx-build -W -n --keep-going -b html docs docs/_build/html`` (what
``tests/test_docs.py`` runs, into a temporary directory). Warnings are errors and
references are nitpicky: every cross-reference must resolve.

Intersphinx (links into the Python, numpy, torch and mpi4py documentation) needs their
``objects.inv`` inventories. Our build machines cannot reach those sites, so intersphinx
is optional: it is used for each project whose inventory is found in ``docs/_inventories``
(``python.inv``, ``numpy.inv``, ``torch.inv``, ``mpi4py.inv``), or for all of them online
with ``COMMLIB_DOCS_INTERSPHINX=1``. Without an inventory, references into those
namespaces are plain text and nitpicky mode ignores them (``nitpick_ignore_regex`` below
lists the namespaces); references to commlib's own objects are always checked.
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

# -- intersphinx (optional, see the module docstring) -------------------------------------
_INVENTORIES = {
    "python": "https://docs.python.org/3",
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
# Names outside commlib: resolved by intersphinx where its inventory is present, plain
# text (and not a warning) otherwise. commlib's own names are never ignored.
_EXTERNAL = r"(torch|numpy|np|mpi4py|MPI|cupy|lightning|pytorch_lightning|accelerate|" \
            r"concurrent|threading|collections|typing|typing_extensions|types|os|pathlib|" \
            r"argparse|enum|dataclasses|contextlib|warnings|socket|io|abc|numba|" \
            r"importlib|subprocess|queue|weakref|functools|sklearn|horovod|nn|optim|F|" \
            r"Tensor|Module|Parameter|Optimizer|dist|datetime)"
nitpick_ignore_regex = [
    (r"py:.*", _EXTERNAL + r"(\..*)?"),
    (r"py:.*", r"c10d::.*"),          # torch's C++ names in its inherited docstrings
]

# -- HTML ---------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"commlib {release}"
html_static_path: list[str] = []
copybutton_prompt_text = r"\$ |>>> |\.\.\. "
copybutton_prompt_is_regexp = True

# -- commlib_docs (docs/_ext/commlib_docs.py) ---------------------------------------------
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
