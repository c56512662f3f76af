"""The algorithm registry: decorator, duplicates, unknown names, entry points."""
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")
import commlib  # noqa: E402
from commlib.algorithms import (  # noqa: E402
    Algorithm,
    available,
    get,
    register,
    reload_entry_points,
)


def test_builtin_is_available():
    assert "gradient_allreduce" in available()
    algo = get("gradient_allreduce", hierarchical=True)
    assert algo.hierarchical and algo.name == "gradient_allreduce"


def test_decorator_registers_and_refuses_a_taken_name():
    @register("test_noop_exchange")
    class Noop(Algorithm):
        def __init__(self, level=1):
            self.level = level

    assert get("test_noop_exchange", level=3).level == 3
    with pytest.raises(ValueError, match="'test_noop_exchange' is taken"):
        @register("test_noop_exchange")
        class Other(Algorithm):
            pass
    with pytest.raises(ValueError, match="taken"):
        register("gradient_allreduce")(type("Clash", (Algorithm,), {}))


def test_register_refuses_non_algorithms():
    with pytest.raises(TypeError, match="not a subclass"):
        register("test_not_an_algorithm")(object)


def test_unknown_name_lists_the_available_ones():
    with pytest.raises(ValueError, match="unknown commlib algorithm 'nope'; available: .*"
                                         "gradient_allreduce"):
        get("nope")


def test_bad_keyword_is_a_type_error():
    with pytest.raises(TypeError):
        get("gradient_allreduce", hierachical=True)


PLUGIN = {
    "pyproject.toml": """
        [build-system]
        requires = ["setuptools>=64"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "commlib-test-plugin"
        version = "0.1"
        [project.entry-points."commlib.algorithms"]
        plugin_average = "commlib_test_plugin:PluginAverage"
    """,
    "commlib_test_plugin/__init__.py": """
        from commlib.algorithms import Algorithm

        class PluginAverage(Algorithm):
            def __init__(self, factor=2):
                self.factor = factor
    """,
}


def test_entry_point_plugin_installed_with_pip(tmp_path, monkeypatch):
    source = tmp_path / "plugin"
    for rel, text in PLUGIN.items():
        path = source / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--no-index", "--target", str(target), str(source)],
                   check=True, timeout=300)
    monkeypatch.syspath_prepend(str(target))
    reload_entry_points()
    assert "plugin_average" in available()
    algo = get("plugin_average", factor=5)
    assert algo.factor == 5 and algo.name == "plugin_average"
    assert isinstance(commlib.algorithms.get("plugin_average"), Algorithm)
