"""The type hints of the public API pass ``mypy --strict``: pyproject.toml's ``[tool.mypy]``
lists the modules that define the public names (``files``), checked strictly; what they
import is followed silently. The package ships ``py.typed`` (tests/test_packaging.py checks
the wheel), so users' type checkers read the same hints. Skipped where mypy is not
installed (it is in the ``test`` extra). About 15 s of CPU without a cache (CI's clean
clone), a few seconds with ``.mypy_cache``."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from helpers import serial_only

pytestmark = serial_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_public_api_passes_mypy_strict():
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install mypy, or the test extra)")
    if importlib.util.find_spec("torch") is None:
        pytest.skip("the checked modules use torch's types (the DDP wrapper)")
    done = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary",
                           "--hide-error-context"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, ("mypy (pyproject.toml's [tool.mypy]) found problems:\n"
                                  + done.stdout + done.stderr)
