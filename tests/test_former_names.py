"""The modules that once lay flat in ``commlib/`` keep their names after the move into the
layers' folders: ``commlib.<former name>`` (and its submodules) is the module at its new
place, the same object, by import, by attribute and by ``python -m``."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

import commlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(commlib.__file__)))

# Written out, not read from commlib._MOVED: a name users import must not drop out.
FORMER = {
    "errors": "commlib.base.errors", "options": "commlib.base.options",
    "accounting": "commlib.base.accounting", "dtypes": "commlib.base.dtypes",
    "reduce_ops": "commlib.base.reduce_ops", "accelerator": "commlib.base.accelerator",
    "buffers": "commlib.base.buffers", "host_views": "commlib.base.host_views",
    "mpi_impl": "commlib.mpi.mpi_impl", "launch": "commlib.mpi.launch",
    "mpi_env": "commlib.mpi.mpi_env", "ucx_env": "commlib.mpi.ucx_env",
    "shm": "commlib.mpi.shm", "shutdown": "commlib.mpi.shutdown",
    "watchdog": "commlib.mpi.watchdog", "ft_backend": "commlib.fault.ft_backend",
    "failure_detection": "commlib.fault.failure_detection",
    "fault_tolerance": "commlib.fault.fault_tolerance", "agreement": "commlib.fault.agreement",
    "communicator": "commlib.core.communicator", "runtime": "commlib.core.runtime",
    "exits": "commlib.core.exits", "timeline": "commlib.services.timeline",
    "topology": "commlib.services.topology", "selftest": "commlib.tools.selftest",
    "info": "commlib.tools.info", "hooks": "commlib.ddp.comm_hooks",
}


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_the_table_is_commlibs():
    assert commlib._MOVED == FORMER


@pytest.mark.parametrize("old", sorted(FORMER))
def test_a_former_name_is_the_module(old):
    if old == "hooks":
        pytest.importorskip("torch")
    new = importlib.import_module(FORMER[old])
    assert importlib.import_module(f"commlib.{old}") is new
    assert sys.modules[f"commlib.{old}"] is new
    if old != "options":  # commlib.options is the Options instance, as before
        assert getattr(commlib, old) is new


@pytest.mark.parametrize("old, new", [
    ("commlib.launch.world", "commlib.mpi.launch.world"),
    ("commlib.launch.environment", "commlib.mpi.launch.environment"),
    ("commlib.mpi_impl.openmpi", "commlib.mpi.mpi_impl.openmpi"),
])
def test_submodules_of_a_moved_package(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)


def test_from_imports_and_the_options_instance():
    from commlib.errors import CommError
    from commlib.options import Options, options
    from commlib.topology import Topology
    assert CommError is commlib.CommError and options is commlib.options
    assert isinstance(commlib.options, Options) and Topology is commlib.Topology


def test_in_a_fresh_process():
    """The first import of a former name (no module of commlib imported before it)."""
    code = ("import commlib.options, commlib.launch.world, commlib.runtime as r, commlib\n"
            "import commlib.mpi.launch.world as w, commlib.core.runtime as r2\n"
            "assert isinstance(commlib.options, commlib.Options), commlib.options\n"
            "assert commlib.launch.world is w and r is r2\n"
            "from commlib.options import options; assert options is commlib.options\n"
            "print('ok')")
    p = run("-c", code)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def test_python_m_a_former_name():
    """``python -m commlib.mpi_impl`` (a package's ``__main__``) runs as it did; so does a
    module's (``commlib.selftest --help``, ``commlib.info --help``)."""
    old, new = run("-m", "commlib.mpi_impl"), run("-m", "commlib.mpi.mpi_impl")
    assert old.returncode == new.returncode == 0, old.stderr + new.stderr
    assert old.stdout == new.stdout and old.stdout.strip()
    for name in ("selftest", "info"):
        old, new = run("-m", f"commlib.{name}", "--help"), run("-m", FORMER[name], "--help")
        assert old.returncode == new.returncode == 0, old.stderr
        assert "usage" in old.stdout and old.stdout == new.stdout
