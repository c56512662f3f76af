"""The code blocks of the docstrings the API reference renders are run, or say why not.

The reference (``docs/reference``) is autodoc: its ``.. automodule::``, ``.. autoclass::``,
``.. autofunction::``... directives (and ``.. commlib-algorithm-classes::``) put docstrings
on the site, code blocks included. This module walks the same objects (a module's
docstring and its public members, a class's docstring and, with ``:members:``, its public
methods and properties, docstrings inherited as autodoc inherits them), parses their code
blocks (``docs/_ext/commlib_docs/docstring_blocks.py``: ``::`` literal blocks,
``.. code-block::``, ``>>>`` doctest blocks) and treats each like a block of a page
(``tests/test_docs.py``): a Python block runs in a fresh directory (``# run: mpiexec -n 2``
under mpiexec), a doctest block runs under :mod:`doctest` (its output compared), a shell
block with ``# run: bash`` runs under ``bash -e``, and ``# not run: REASON`` (or a
``.. not run: REASON`` comment above the block) says why a block is not runnable here. A
block that is neither fails ``test_every_docstring_block_is_run_or_marked``.

The walk is checked against the site: the extension records every docstring code block
autodoc rendered (``commlib_docstring_blocks.json`` in the doctree directory) and
``tests/test_docs.py::test_site_builds_without_warnings`` asserts each is one this module
runs or counts; the build itself fails on an unmarked one.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
import types
from pathlib import Path

import pytest

from helpers import serial_only
from test_docs import SHELL, run_snippet

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PARSER = DOCS / "_ext" / "commlib_docs" / "docstring_blocks.py"   # no Sphinx import


def _load_parser():
    spec = importlib.util.spec_from_file_location("commlib_docstring_blocks", PARSER)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


blocks_mod = _load_parser()
DocBlock = blocks_mod.DocBlock
parse_docstring = blocks_mod.parse_docstring

# -- the objects the reference documents --------------------------------------------------

_AUTO = re.compile(r"^(?P<indent>\s*)\.\.\s+auto(?P<kind>module|class|exception|function|"
                   r"method|data|attribute|property|decorator)::\s+(?P<target>\S+)\s*$")
_OPTION = re.compile(r"^\s+:(?P<name>[\w-]+):\s*(?P<value>.*)$")
_BUILTIN_VALUES = (str, bytes, int, float, bool, tuple, list, dict, set, frozenset,
                   type(None))


def reference_directives(pages: list[Path] | None = None) -> list[tuple[str, str, dict]]:
    """``(kind, target, options)`` of every autodoc directive of the reference's pages
    (``.rst``; options: ``members`` (None: all, else the names), ``exclude-members``,
    ``no-members``), and ``("algorithms", "", {})`` for ``.. commlib-algorithm-classes::``."""
    if pages is None:
        pages = sorted(p for p in DOCS.rglob("*.rst") if "_build" not in p.parts)
    out = []
    for page in pages:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() == ".. commlib-algorithm-classes::":
                out.append(("algorithms", "", {}))
            m = _AUTO.match(line)
            if not m:
                continue
            options: dict = {}
            for follow in lines[i + 1:]:
                o = _OPTION.match(follow)
                if not o:
                    break
                value = o["value"].strip()
                names = [v.strip() for v in value.split(",") if v.strip()]
                options[o["name"]] = names or None
            out.append((m["kind"], m["target"], options))
    return out


def _resolve(fullname: str):
    parts = fullname.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(fullname)


def _module_members(module: types.ModuleType) -> list[str]:
    """The names ``automodule :members:`` documents: ``__all__``, else the public classes
    and functions the module defines."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [n for n, v in vars(module).items() if not n.startswith("_") and
            (inspect.isclass(v) or inspect.isfunction(v)) and
            getattr(v, "__module__", None) == module.__name__]


def _class_members(cls: type) -> list[tuple[str, object]]:
    """The public members a class defines (what ``autoclass :members:`` shows, undocumented
    ones included), each as autodoc reads its docstring."""
    out = []
    for name, raw in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(raw, (staticmethod, classmethod)) or inspect.isfunction(raw):
            out.append((name, getattr(cls, name)))
        elif isinstance(raw, property) or inspect.isclass(raw):
            out.append((name, raw))
        elif inspect.isdatadescriptor(raw) or inspect.ismethoddescriptor(raw):
            out.append((name, raw))
    return out


def documented_objects(directives=None) -> dict[str, object]:
    """Full name -> object, for every docstring the reference renders (a superset: a
    member list of ``automodule`` is not applied to the classes' own members, and the
    modules of the built-in algorithms are included)."""
    if directives is None:
        directives = reference_directives()
    found: dict[str, object] = {}

    def add(name: str, obj: object, members: bool) -> None:
        if name in found:
            return
        if not (inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(obj) or
                isinstance(obj, property) or type(obj) not in _BUILTIN_VALUES):
            return
        if type(obj) in _BUILTIN_VALUES:
            return                    # a constant: its text is the directive's content
        found[name] = obj
        if inspect.isclass(obj) and members:
            for member, value in _class_members(obj):
                add(f"{name}.{member}", value, inspect.isclass(value))

    for kind, target, options in directives:
        if kind == "algorithms":
            from commlib.algorithms import available, registry
            for algo in available():
                cls = registry.lookup(algo)
                add(f"{cls.__module__}.{cls.__qualname__}", cls, False)
                # and the modules that define them: not on the site, but their docstrings
                # describe these classes (help() shows them), examples included
                module = cls.__module__
                while module.startswith("commlib.algorithms."):
                    add(module, sys.modules[module], False)
                    module = module.rpartition(".")[0]
            continue
        obj = _resolve(target)
        members = "members" in options and "no-members" not in options
        if kind != "module":
            add(target, obj, members)
            continue
        add(target, obj, False)
        if not members:
            continue
        names = options["members"] or _module_members(obj)
        excluded = set(options.get("exclude-members") or ())
        for name in names:
            if name not in excluded and hasattr(obj, name):
                add(f"{target}.{name}", getattr(obj, name), True)
    return found


def docstring_blocks(objects: dict[str, object] | None = None) -> list[DocBlock]:
    """The code blocks of the documented docstrings, each once (a block several names
    share, a class shown under ``commlib`` and its own module, counts once)."""
    if objects is None:
        objects = documented_objects()
    out: list[DocBlock] = []
    seen: set[str] = set()
    for name, obj in objects.items():
        for block in blocks_mod.object_blocks(obj, name):
            if block.code not in seen:
                seen.add(block.code)
                out.append(block)
    return out


def unmarked(blocks: list[DocBlock]) -> list[DocBlock]:
    return [b for b in blocks if b.not_run is None and not b.runs]


def doctest_script(block: DocBlock) -> str:
    """A script that runs a doctest block under :mod:`doctest` (ELLIPSIS,
    NORMALIZE_WHITESPACE) and exits non-zero on a failed example."""
    return ("import doctest, sys\n"
            f"TEXT = {block.code!r}\n"
            "test = doctest.DocTestParser().get_doctest(TEXT, {'__name__': '__main__'}, "
            f"{block.id!r}, None, 0)\n"
            "runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | "
            "doctest.NORMALIZE_WHITESPACE)\n"
            "runner.run(test)\n"
            "sys.exit(1 if runner.failures else 0)\n")


def run_block(block: DocBlock, timeout: float | None = None) -> tuple[int, float, str]:
    """Run one block the way :func:`test_docs.run_snippet` runs a page's."""
    code = doctest_script(block) if block.doctest else block.code
    lang = block.lang if block.lang in SHELL else "python"
    kwargs = {"timeout": timeout} if timeout is not None else {}
    return run_snippet(code, block.launch, lang=lang, **kwargs)


BLOCKS = docstring_blocks()


def _tally(blocks: list[DocBlock]) -> str:
    run = [b for b in blocks if b.runs]
    marked = [b for b in blocks if b.not_run is not None]
    mpi = sum(b.launch is not None and b.launch != "bash" for b in run)
    reasons: dict[str, list[str]] = {}
    for b in marked:
        reasons.setdefault(b.not_run, []).append(b.id)
    return (f"{len(blocks)} docstring code blocks, {len(run)} run ({mpi} under mpiexec, "
            f"{sum(b.doctest for b in run)} doctest, "
            f"{sum(b.launch == 'bash' for b in run)} shell), {len(marked)} marked not "
            f"runnable:\n" + "\n".join(f"  {why}: {', '.join(ids)}"
                                      for why, ids in sorted(reasons.items())))


def test_docstring_blocks_are_found_and_marked():
    """The walk finds the reference's docstring blocks; markers are well formed; the tally
    is reported."""
    objects = documented_objects()
    assert "commlib.allreduce" in objects and "commlib.algorithms" in objects
    assert "commlib.DistributedDataParallel.join" in objects
    assert len(BLOCKS) >= 8, [b.id for b in BLOCKS]
    from test_docs import launch_command
    for b in BLOCKS:
        if b.launch is not None:
            launch_command(b.launch, "x.py", b.lang if b.lang in SHELL else "python")
        assert b.not_run is None or len(b.not_run) > 5, b.id
    print(f"\n{len(objects)} documented objects; {_tally(BLOCKS)}")


def test_every_docstring_block_is_run_or_marked():
    assert not unmarked(BLOCKS), [f"{b.id} ({b.lang})" for b in unmarked(BLOCKS)]


# Docstrings this change could not edit (another change owns the module at the time):
# their blocks run and are expected to fail until they are fixed or marked; strict, so
# the entry must go once they pass.
PENDING: dict[str, str] = {}


def _params(blocks: list[DocBlock]) -> list:
    return [pytest.param(b, id=b.id, marks=[pytest.mark.xfail(strict=True,
                                                              reason=PENDING[b.obj])]
                         if b.obj in PENDING else []) for b in blocks]


@serial_only
@pytest.mark.parametrize("block", _params(BLOCKS))
def test_docstring_block_runs(block: DocBlock):
    if block.not_run is not None:
        pytest.skip(f"not run: {block.not_run}")
    if not block.runs:
        pytest.fail(f"{block.id}: a {block.lang!r} block with no marker")
    status, took, out = run_block(block)
    assert status == 0, (f"{block.id} ({block.launch or 'one process'}) exited with "
                         f"{status} after {took:.1f} s:\n{out[-4000:]}")


# -- the parser and the walk, and their negative controls ---------------------------------

_SAMPLE = '''Summary.

Example::

    x = 1

.. note::

   Not code.

.. not run: a diagram

::

    a -> b

Text ending ``a::b`` in prose, and a shell block:

.. code-block:: bash
   :caption: launch

   # run: bash
   echo ok

Args:
    n: a number, with an example::

        # run: mpiexec -n 2
        import commlib

>>> 1 + 1
2

.. code-block:: toml

   x = 1
'''


def test_docstring_parser():
    got = parse_docstring(_SAMPLE, "m.f")
    assert [(b.line, b.lang, b.doctest, b.launch, b.not_run) for b in got] == [
        (5, "python", False, None, None), (15, "python", False, None, "a diagram"),
        (22, "bash", False, "bash", None), (28, "python", False, "mpiexec -n 2", None),
        (31, "pycon", True, None, None), (36, "toml", False, None, None)]
    assert got[0].code == "x = 1\n" and got[3].code == "# run: mpiexec -n 2\nimport commlib\n"
    assert [b.id for b in unmarked(got)] == ["m.f:36"]


def _fake_module(doc_f: str) -> str:
    """A module ``commlib_fake_doc`` in ``sys.modules`` with a class whose method ``f`` has
    docstring ``doc_f``."""
    module = types.ModuleType("commlib_fake_doc", "A module.")

    class Thing:
        """A thing."""

        def f(self):
            pass

    Thing.__module__ = module.__name__
    Thing.f.__doc__ = doc_f
    module.Thing = Thing
    sys.modules[module.__name__] = module
    return module.__name__


def test_walk_reaches_members_and_catches_an_unmarked_block(monkeypatch):
    """Negative control of the walk: a method's block, under ``automodule :members:``, is
    found; a shell block without a marker there is reported, with a marker it is not."""
    name = _fake_module("Do it::\n\n    # run: bash\n    echo ok\n\n.. code-block:: bash\n\n"
                        "   srun python train.py\n")
    try:
        objects = documented_objects([("module", name, {"members": None})])
        assert f"{name}.Thing.f" in objects
        blocks = docstring_blocks(objects)
        assert [(b.obj, b.lang, b.runs) for b in blocks] == [
            (f"{name}.Thing.f", "python", True), (f"{name}.Thing.f", "bash", False)]
        assert unmarked(blocks) == [blocks[1]]
        # without :members:, the method is not on the site
        assert list(documented_objects([("module", name, {})])) == [name]
    finally:
        del sys.modules[name]


@serial_only
def test_negative_control_broken_docstring_blocks_fail():
    """A broken docstring example fails: a Python block raising, a diagram left unmarked
    (read as Python), a doctest whose output is wrong, and a rank of two failing."""
    doc = ("Example::\n\n    import commlib\n    commlib.no_such_function()\n\n"
           "Flow::\n\n    a -> b -> c\n\n>>> 1 + 1\n3\n\n"
           "Two ranks::\n\n    # run: mpiexec -n 2\n    import commlib\n    commlib.init()\n"
           "    if commlib.get_rank() == 1:\n        raise RuntimeError('rank 1 broke')\n"
           "    commlib.barrier()\n")
    got = parse_docstring(doc, "m.broken")
    assert len(got) == 4 and all(b.runs for b in got)
    for block, needle in zip(got, ["no_such_function", "SyntaxError", "Expected", "rank 1"]):
        status, _, out = run_block(block, timeout=60)
        assert status != 0 and needle in out, (block.id, out[-2000:])
    ok = parse_docstring(">>> sum([1, 2])\n3\n", "m.ok")[0]
    assert run_block(ok, timeout=60)[0] == 0
