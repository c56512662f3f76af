"""``ruff check`` is clean on the package, the kernels, the tests, the benchmarks and the
documentation's extension (pyproject.toml's ``[tool.ruff]``: ruff's default rules, import
sorting and the pyupgrade set for Python 3.10). Lint only: the code is not formatted by
ruff. Skipped where ruff is not installed (it is in the ``test`` extra)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from helpers import serial_only

pytestmark = serial_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKED = ["commlib", "kernels", "tests", "benchmarks", "commlib_autoload", "docs/_ext"]


def test_ruff_check_is_clean():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install ruff, or the test extra)")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache",
                           "--output-format", "concise", *CHECKED],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (
        "ruff check found problems (`ruff check --fix` fixes the [*] ones):\n"
        + done.stdout + done.stderr)
