"""The package list; everything else is in pyproject.toml.

Nothing but ``commlib`` and ``commlib_autoload`` at the top level: the compression kernels,
kept in the ``kernels/`` folder, install as ``commlib.kernels`` (a top-level ``kernels`` is
Hugging Face's package, which transformers uses). pyproject.toml's ``[tool.setuptools]``
cannot combine ``packages.find`` with a mapped subpackage, and a fixed list would leave a
new package under ``commlib/`` out of the wheel (tests/test_packaging.py checks both).
"""
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["commlib", "commlib.*", "commlib_autoload"])
    + ["commlib.kernels"],
    package_dir={"commlib.kernels": "kernels"},
    # PEP 561: the package's type hints are for its users' type checkers too
    package_data={"commlib": ["py.typed"]},
)
