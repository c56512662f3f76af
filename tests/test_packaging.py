"""The distribution has nothing but ``commlib`` and ``commlib_autoload`` at the top level.

The compression kernels, kept in the ``kernels/`` folder, install as ``commlib.kernels``
(setup.py's package_dir): a top-level ``kernels`` is Hugging Face's package, which
transformers uses, and with both installed the name was one or the other (commlib's
compressed algorithms then failed with ``module 'kernels' has no attribute
'compressed_nbytes'``). Checked on a wheel built from this checkout (its entries, then
installed and run), on the editable install the tests run in, and with Hugging Face's
``kernels`` installed (commlib's ``test`` extra) at 2 ranks.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

import commlib
from helpers import clean_env, run_mpi, serial_only

pytestmark = serial_only

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TOP_LEVEL = {"commlib", "commlib_autoload"}
# not copied to the build: what a fresh checkout does not have (environments, build output)
NOT_SOURCE = {".git", "build", "dist", "wheelhouse", ".hypothesis", ".pytest_cache",
              "__pycache__", ".mypy_cache", ".ruff_cache"}


def _ignore(folder: str, names: list[str]) -> set[str]:
    skip = {n for n in names if n in NOT_SOURCE or n.endswith(".egg-info")}
    if os.path.samefile(folder, ROOT):
        skip |= {n for n in names if n.startswith(".venv") or n == "venv"}
    if os.path.samefile(folder, os.path.join(ROOT, "benchmarks")):
        skip |= {"results"} & set(names)
    return skip


def _sources(folder: str) -> set[str]:
    """The .py files under ``folder``, relative to it, with ``/`` separators."""
    found = set()
    for where, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        found |= {os.path.relpath(os.path.join(where, f), folder).replace(os.sep, "/")
                  for f in files if f.endswith(".py")}
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    """A wheel built from a copy of this checkout (the build writes build/ and egg-info
    into the tree it builds), by pip with the setuptools of this environment, offline."""
    base = tmp_path_factory.mktemp("wheel")
    src = str(base / "src")
    shutil.copytree(ROOT, src, ignore=_ignore, symlinks=True)
    out = str(base / "out")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "--no-index", "-q", "-w", out, src],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    (name,) = os.listdir(out)
    return os.path.join(out, name)


def test_wheel_holds_commlib_alone_with_the_kernels_under_it(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        tops = {n.split("/")[0] for n in names}
        (dist_info,) = {t for t in tops if t.endswith(".dist-info")}
        assert tops - {dist_info} == TOP_LEVEL, sorted(tops)
        if f"{dist_info}/top_level.txt" in names:
            listed = zf.read(f"{dist_info}/top_level.txt").decode().split()
            assert set(listed) == TOP_LEVEL, listed
        record = zf.read(f"{dist_info}/RECORD").decode().splitlines()
        assert {line.split(",")[0].split("/")[0] for line in record} == TOP_LEVEL | {dist_info}
    # PEP 561's marker: type checkers read the package's hints
    assert "commlib/py.typed" in names, "commlib/py.typed is not in the wheel"
    kernels = {"commlib/kernels/" + f for f in _sources(os.path.join(ROOT, "kernels"))}
    assert {"commlib/kernels/__init__.py", "commlib/kernels/_api.py"} <= kernels
    assert not kernels - names, f"kernels missing from the wheel: {sorted(kernels - names)}"
    # every module of the source tree (setup.py finds commlib's packages: none is left out)
    for package in sorted(TOP_LEVEL):
        modules = {f"{package}/{f}" for f in _sources(os.path.join(ROOT, package))}
        assert not modules - names, (f"not in the wheel (setup.py's package list?) "
                                     f"{sorted(modules - names)}")


def test_installed_wheel_runs_its_kernels(wheel, tmp_path):
    """The wheel installed on its own (``pip install --target``), first on the path, in a
    process started outside the checkout: commlib and commlib.kernels come from it, the
    kernels run, and no top-level ``kernels`` is commlib's."""
    target = str(tmp_path / "site")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                           "-q", "--target", target, wheel],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    installed = {n for n in os.listdir(target) if not n.endswith(".dist-info")}
    assert installed - {"bin"} == TOP_LEVEL, sorted(installed)   # bin/: the console scripts
    code = (
        "import importlib.util, os, sys\n"
        "import numpy as np\n"
        "import commlib\n"
        "from commlib import kernels\n"
        "x = np.linspace(-1, 1, 1000, dtype=np.float32)\n"
        "y = kernels.decompress(kernels.quantize_minmax_uint8(x, 64))\n"
        "assert np.abs(y - x).max() <= (64 * 2 / 999) / 510 + 1e-7, np.abs(y - x).max()\n"
        "top = importlib.util.find_spec('kernels')\n"
        "print(commlib.__file__, kernels.__file__, top and top.origin, sep='\\n')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=240, env=clean_env(PYTHONPATH=target))
    assert done.returncode == 0, done.stdout + done.stderr
    package, kernels, top = done.stdout.split("\n")[-4:-1]
    assert package == os.path.join(target, "commlib", "__init__.py"), package
    assert kernels == os.path.join(target, "commlib", "kernels", "__init__.py"), kernels
    ours = (os.path.join(target, "kernels"), os.path.join(ROOT, "kernels"))
    assert not top.startswith(ours), f"a top-level kernels of commlib's: {top}"


def test_editable_install_maps_the_kernels_folder(tmp_path):
    """In the editable install (the README's and CI's), commlib.kernels is the kernels/
    folder of this checkout, and outside the checkout the top-level name ``kernels`` is
    not it (nothing, or Hugging Face's)."""
    if os.path.dirname(os.path.abspath(commlib.__file__)) != os.path.join(ROOT, "commlib"):
        pytest.skip(f"commlib is not this checkout's (an installed copy: {commlib.__file__})")
    from commlib import kernels
    ours = os.path.join(ROOT, "kernels", "__init__.py")
    assert os.path.samefile(kernels.__file__, ours), kernels.__file__
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s and s.origin)"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=clean_env(PYTHONPATH=None))
    assert done.returncode == 0, done.stderr
    top = done.stdout.strip()
    assert top == "None" or not os.path.samefile(top, ours), top


def test_compressed_allreduce_beside_hugging_face_kernels():
    """tests/hf_kernels_program.py at 2 ranks: Hugging Face's kernels imported, then the
    compressed (min-max uint8) and int4 allreduces against the uncompressed one."""
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's kernels is not installed (commlib's test extra has it)")
    code, seconds, out = run_mpi(2, [os.path.join(HERE, "hf_kernels_program.py")],
                                 timeout=240)
    assert code == 0, out
    assert sorted(re.findall(r"OK (\d+)", out)) == ["0", "1"], out   # ranks' lines may mix
