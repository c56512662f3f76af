"""torch's ``torch.backends`` entry point (``commlib_autoload``, declared in pyproject.toml):
``init_process_group("commlib")`` in a script that never imports commlib, under ``mpiexec``,
while ``import torch`` itself imports and initializes nothing of commlib or MPI.
(The entry point is read from pyproject.toml, see ``entry_points.py``.)"""
import json
import os
import re
import subprocess
import sys

import pytest

from entry_points import autoload_pythonpath, declared
from helpers import clean_env, run_mpi, serial_only

pytest.importorskip("torch")
tomllib = pytest.importorskip("tomllib")
HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "autoload_program.py")
pytestmark = serial_only


@pytest.fixture
def autoload_path(tmp_path):
    assert declared() == {"commlib": "commlib_autoload:register"}
    return autoload_pythonpath(tmp_path)


CHECK = ("import sys, json, torch, torch.distributed as d; print('SEEN ' + json.dumps("
         "['commlib' in sys.modules, 'mpi4py' in sys.modules, 'commlib' in d.Backend.backend_list,"
         " d.Backend.default_device_backend_map['cpu']]))")


def seen_at_import(path, **env):
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                          timeout=300, env=clean_env(PYTHONPATH=path, **env))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(re.findall(r"SEEN (\[.*\])", proc.stdout)[0])


def test_import_torch_registers_and_initializes_nothing(autoload_path):
    # Registered; commlib and mpi4py not imported; torch's default CPU backend unchanged.
    assert seen_at_import(autoload_path) == [False, False, True, "gloo"]
    # Negative control: with torch's autoload off, the backend is unknown.
    assert seen_at_import(autoload_path, TORCH_DEVICE_BACKEND_AUTOLOAD="0") == \
        [False, False, False, "gloo"]


def test_script_without_commlib_import_under_mpiexec(autoload_path):
    n = 2
    code, _, out = run_mpi(n, [PROGRAM], timeout=300, PYTHONPATH=autoload_path)
    assert code == 0, out[-3000:]
    reports = [json.loads(m) for m in re.findall(r"AUTOLOAD (\{.*\})", out)]
    assert sorted(r["rank"] for r in reports) == list(range(n)), out[-3000:]
    for r in reports:
        assert not r["commlib_at_import"] and not r["mpi_at_import"] and r["registered"]
        assert r["sum"] == n * (n + 1) / 2 and r["gathered"] == list(range(n))
        assert r["evens"] == (len(range(0, n, 2)) if r["rank"] % 2 == 0 else 1)
        assert r["group"] == "ProcessGroupCommlib" and r["commlib_after"]
