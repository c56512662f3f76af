"""The house's layering, checked on the source: no import cycles among commlib's modules
(imports inside functions and under ``TYPE_CHECKING`` count), and no layer imports one
above it. Each layer is a folder of ``commlib/`` (the package root holds nothing else but
``__init__`` and ``__main__``): kernels -> base -> mpi -> fault -> core -> primitives ->
services -> algorithms -> the front-ends -> run -> integrations -> the package and its
tools. ``commlib.kernels`` (its source is the ``kernels/`` folder, mapped under commlib by
setup.py) is the bottom: pure compute, importing nothing else of commlib and no MPI."""
from __future__ import annotations

import ast
import importlib.util
import os

import commlib

ROOT = os.path.dirname(os.path.dirname(commlib.__file__))

LAYERS = [
    {"kernels"},
    {"base"},        # errors, options, dtypes, reduce_ops, buffers, accelerator, accounting
    {"mpi"},         # mpi_impl/, launch/, mpi_env, ucx_env, shm, shutdown, watchdog
    {"fault"},       # ft_backend, failure_detection, agreement, waits, helper_thread, fault_tolerance
    {"core"},        # communicator, runtime, exits
    {"primitives"},
    {"services"},    # timeline, topology
    {"algorithms"},
    {"ddp", "sharded", "embedding", "pipeline", "parallel", "torch_backend", "nn", "elastic",
     "horovod"},
    {"run"},
    {"integrations"},
    {"commlib", "examples", "tools", "__main__"},
]


def kernels_dir() -> str:
    """Where ``commlib.kernels`` is found (the ``kernels/`` folder in an editable install,
    ``commlib/kernels`` in a wheel's), without importing it."""
    spec = importlib.util.find_spec("commlib.kernels")
    assert spec is not None and spec.origin, "commlib.kernels is not importable"
    return os.path.dirname(spec.origin)


def modules() -> dict[str, str]:
    found = {}
    trees = [(os.path.join(ROOT, "commlib"), "commlib"), (kernels_dir(), "commlib.kernels")]
    for top, package in trees:
        for folder, _, files in os.walk(top):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    rel = os.path.relpath(path, top)[:-3].replace(os.sep, ".")
                    name = package + "." + rel
                    found[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    assert "commlib.kernels._api" in found and "commlib.primitives" in found, sorted(found)
    return found


def import_graph(mods: dict[str, str],
                 unresolved: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """Module -> the commlib modules it imports (a name imported from a package is the
    submodule when there is one, else the package); ``unresolved`` gets the other names
    each imports."""
    graph = {}
    for name, path in mods.items():
        package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        targets = set()
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1])
                    target = base + ("." + node.module if node.module else "")
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    targets.add(sub if sub in mods else target)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif (isinstance(node, ast.Call) and node.args
                  and getattr(node.func, "id", getattr(node.func, "attr", None))
                  == "import_module" and isinstance(node.args[0], ast.Constant)
                  and str(node.args[0].value).startswith(".")):
                sub = package + node.args[0].value
                targets.add(sub if sub in mods else package)
        graph[name] = {t for t in targets if t in mods and t != name}
        if unresolved is not None:
            unresolved[name] = {t for t in targets if t not in mods}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else "commlib"
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module}: not in any layer of tests/test_layering.py; add it")


def test_no_import_cycles():
    found = cycles(import_graph(modules()))
    assert not found, f"import cycles: {found}"


def test_no_layer_imports_upward():
    graph = import_graph(modules())
    upward = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                    if layer(t) > layer(m))
    assert not upward, f"imports from a lower layer into a higher one: {upward}"


def test_no_module_imports_a_former_name():
    """Inside commlib, a moved module is imported at its place in its layer's folder, not by
    its former flat name (``commlib.runtime``, which commlib/__init__ keeps for users and
    which the layer checks above would not see)."""
    unresolved: dict[str, set[str]] = {}
    import_graph(modules(), unresolved)
    former = {f"commlib.{old}" for old in commlib._MOVED}
    found = sorted(f"{m} -> {t}" for m, ts in unresolved.items() for t in ts
                   if t in former or any(t.startswith(f + ".") for f in former))
    assert not found, found


def test_kernels_are_pure_compute():
    """commlib.kernels imports nothing of commlib but itself (the layer check: it is the
    bottom layer) and no MPI, anywhere in its modules."""
    graph = import_graph(modules())
    kernels = [m for m in graph if m == "commlib.kernels" or m.startswith("commlib.kernels.")]
    assert len(kernels) > 10 and all(layer(m) == 0 for m in kernels)
    for name in kernels:
        with open(modules()[name], encoding="utf-8") as f:
            tree = ast.parse(f.read())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module or "" for n in ast.walk(tree)
                     if isinstance(n, ast.ImportFrom) and not n.level}
        assert not {m for m in imported if m.split(".")[0] in ("mpi4py", "commlib")}, name


def test_no_module_imports_a_top_level_kernels():
    """``import kernels`` is Hugging Face's package wherever theirs is installed: commlib's
    kernels are ``commlib.kernels`` (``from .. import kernels``) only."""
    found = []
    for name, path in modules().items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            found += [f"{name}: {n}" for n in names if n.split(".")[0] == "kernels"]
    assert not found, found


def test_the_checks_can_fail():
    """Negative controls: a cycle and an upward import are found in a made-up graph."""
    graph = {"commlib.core.runtime": {"commlib.services.timeline"},
             "commlib.services.timeline": {"commlib.primitives.barrier"},
             "commlib.primitives.barrier": {"commlib.core.runtime"}, "commlib.base.errors": set()}
    assert cycles(graph) == [sorted(["commlib.core.runtime", "commlib.services.timeline",
                                     "commlib.primitives.barrier"])]
    assert layer("commlib.services.timeline") > layer("commlib.core.runtime")
    assert layer("commlib.primitives.compressed") > layer("commlib.kernels._api")
    assert layer("commlib.integrations.accelerate") > layer("commlib.run")
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_root_holds_the_layers_folders_only():
    """``commlib/`` holds ``__init__``, ``__main__`` and one folder a layer, each named in
    :data:`LAYERS` (a module or folder left flat in the root, or not placed, fails)."""
    top = os.path.join(ROOT, "commlib")
    placed = set().union(*LAYERS)
    files = sorted(f for f in os.listdir(top) if f.endswith(".py"))
    assert files == ["__init__.py", "__main__.py"], files
    folders = sorted(f for f in os.listdir(top)
                     if os.path.isfile(os.path.join(top, f, "__init__.py")))
    assert set(folders) <= placed, set(folders) - placed
