"""Sphinx extension of commlib's documentation: pages generated from the code and the
results at build time, and the check that the API reference is complete.

Directives (their output is built when the site is, so it cannot drift from the code):

``.. commlib-options::``
    the table of :data:`commlib.options` (name, environment variable, default, meaning),
    read from ``commlib.base.options._FIELDS``, plus the runner's and the launcher's variables.
``.. commlib-cli:: MODULE``
    ``python -m MODULE --help``, run at build time.
``.. commlib-benchmarks::``
    a table per ``benchmarks/results/*.json`` file (``commlib_results_dir``).
``.. commlib-algorithm:: NAME`` (also in Markdown pages)
    the registered class of a DDP algorithm and its knobs (its ``__init__`` signature).
``.. commlib-algorithm-classes::``
    ``autoclass`` of every registered built-in algorithm.

The check: after every page is read, each public name of the modules listed in
``commlib_public_modules`` (their ``__all__``, else the public classes and functions they
define) must be described somewhere in the reference (as itself, or, for a re-exported
class or function, the same object under another public name); a missing one is a
warning, so ``sphinx-build -W`` fails.

Docstring code blocks: every code block of a docstring autodoc renders must be runnable
or marked not runnable (``commlib_docstring_blocks.py``; an unmarked one is a warning);
the blocks are recorded in ``commlib_docstring_blocks.json`` in the doctree directory,
which ``tests/test_docs.py`` compares with the blocks ``tests/test_docstring_examples.py``
runs.
"""
from __future__ import annotations

import glob
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx import addnodes
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

from commlib_docstring_blocks import parse_docstring

logger = logging.getLogger(__name__)


def _parse_rst(directive: SphinxDirective, text: str) -> list[nodes.Node]:
    """Parse generated reStructuredText (only used from .rst pages)."""
    container = nodes.section()
    container.document = directive.state.document
    lines = StringList(text.splitlines(), source=f"<{directive.name}>")
    nested_parse_with_titles(directive.state, lines, container, directive.content_offset)
    return container.children


def _cell(text: str) -> str:
    return " ".join(str(text).split())


def _list_table(header: list[str], rows: list[list[str]], widths: str | None = None) -> str:
    out = [".. list-table::", "   :header-rows: 1"]
    if widths:
        out.append(f"   :widths: {widths}")
    out.append("")
    for row in [header, *rows]:
        for i, cell in enumerate(row):
            out.append(("   * - " if i == 0 else "     - ") + (_cell(cell) or "\\-"))
    out.append("")
    return "\n".join(out)


# -- options ------------------------------------------------------------------------------

class OptionsDirective(SphinxDirective):
    has_content = False

    def run(self) -> list[nodes.Node]:
        options_module = importlib.import_module("commlib.base.options")
        environment = importlib.import_module("commlib.mpi.launch.environment")
        self.env.note_dependency(options_module.__file__)
        rows = []
        for name, (_parse, default, var, doc) in options_module._FIELDS.items():
            rows.append([f"``{name}``", f"``{var}``", f"``{default!r}``", doc])
        text = _list_table(["option", "environment variable", "default", "meaning"], rows,
                           "12 20 8 60")
        text += ("\nRead by the runner (``python -m commlib``, :class:`commlib.run.Config`), "
                 "not by :data:`commlib.options`: "
                 + ", ".join(f"``{v}``" for v in options_module.RUNNER_VARIABLES) + ".\n")
        text += ("\nRead by the launch layer before MPI starts (:mod:`commlib.mpi.launch`): "
                 + ", ".join(f"``{v}``" for v in environment.VARIABLES) + ".\n")
        return _parse_rst(self, text)


# -- CLI ----------------------------------------------------------------------------------

class CliDirective(SphinxDirective):
    required_arguments = 1
    option_spec = {"args": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        module = self.arguments[0]
        args = self.options.get("args", "--help").split()
        env = {**os.environ, "COMMLIB_TORCH_ENV": "0", "COLUMNS": "90"}
        env.pop("COMMLIB_CHECK", None)
        cmd = [sys.executable, "-m", module, *args]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        except subprocess.TimeoutExpired:
            logger.warning("commlib-cli: %s timed out", " ".join(cmd), location=self.get_location())
            return []
        text = done.stdout.strip() or done.stderr.strip()
        if done.returncode != 0:
            logger.warning("commlib-cli: %s exited with %d: %s", " ".join(cmd), done.returncode,
                           done.stderr.strip()[-500:], location=self.get_location())
        shown = f"$ python -m {module} {' '.join(args)}\n{text}"
        block = nodes.literal_block(shown, shown)
        block["language"] = "text"
        return [block]


# -- benchmarks ---------------------------------------------------------------------------

def _fmt(x: Any, digits: int = 3, none: str = "-") -> str:
    if x is None:
        return none
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e6:
        return str(int(x))
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _env_line(env: dict[str, Any]) -> str:
    parts = []
    for key in ("timestamp", "host", "mpi_library", "ranks", "cpu_count", "git_commit"):
        if key in env:
            value = str(env[key]).split("\n")[0]
            parts.append(f"{key} ``{value[:60]}``")
    return ", ".join(parts)


def _summarise_collectives(data: dict) -> str:
    env = data.get("environment", {})
    text = f"{data.get('label', '')}. {_env_line(env)}.\n\n"
    argv = env.get("argv")
    if argv:
        text += f"Made by::\n\n    mpiexec -n {env.get('ranks', 'N')} python {' '.join(argv)}\n\n"
    rows = [[r.get("op"), _fmt(r.get("added_us")), _fmt(r.get("geomean_ratio")),
             _fmt(r.get("min_ratio")), _fmt(r.get("min_ratio_bytes")), r.get("latency"),
             r.get("bandwidth")] for r in data.get("summary", [])]
    text += _list_table(["operation", "added latency (us, 8 B)", "geomean commlib/MPI bandwidth",
                         "worst ratio", "at bytes", "latency target", "bandwidth target"], rows)
    return text


def _summarise_tta(data: dict) -> str:
    cfg = data.get("config", {})
    text = (f"Time to accuracy, model ``{cfg.get('gpt_size', cfg.get('model', '?'))}``, "
            f"{cfg.get('epochs', '?')} epochs, batch {cfg.get('batch', '?')} per rank. "
            f"Target: {data.get('target_rule', '?')}.\n\n")
    if data.get("combined_from"):
        text += f"Combined from {len(data['combined_from'])} runs (seeds and shapes).\n\n"
    for panel, p in data.get("panels", {}).items():
        summary = p.get("summary", {})
        rows = []
        for name, s in summary.items():
            if name.startswith("_") or not isinstance(s, dict):
                continue
            rows.append([f"``{name}``", _fmt(s.get("time_to_target_s"), none="not reached"),
                         _fmt(s.get("ttt_vs_torch_ddp")), _fmt(s.get("bus_ratio_vs_sync")),
                         _fmt(s.get("final_acc_worst"), 4), _fmt(s.get("samples_per_s"))])
        if rows:
            text += f"**{panel}** ({p.get('nodes', '?')} nodes x {p.get('ranks_per_node', '?')} " \
                    f"ranks, {_fmt(p.get('rate_mbit'))} Mbit/s between nodes; 0: unshaped)\n\n"
            text += _list_table(["contender", "time to target (s)", "vs torch DDP",
                                 "bus bytes vs sync",
                                 "final accuracy, worst replica (GPT: minus the loss)",
                                 "samples/s"], rows)
            text += "\n"
    return text


def _summarise_partition(data: dict) -> str:
    text = (f"``bench_partition``: GPT with {data.get('layers')} layers, context "
            f"{data.get('context')}, micro-batch {data.get('batch')}, {data.get('ranks')} ranks, "
            f"{data.get('mpi', '').strip()}. {data.get('note', '')}.\n\n")
    rows = []
    for step in data.get("steps", []):
        times = step.get("step_s", {})
        auto = times.get("auto")
        for name, t in times.items():
            ratio = _fmt(t / auto) if auto else "-"
            rows.append([str(step.get("stages")), str(step.get("micro_batches")), name,
                         _fmt(t * 1e3), ratio])
    text += _list_table(["stages", "micro-batches", "cut", "1F1B step (ms)", "vs auto"], rows)
    return text


def _summarise_cost_model(data: dict) -> str:
    text = (f"The cost model calibrated on the ``{data.get('workload')}`` workload; "
            f"{len(data.get('validation', []))} step times validated against measurements. "
            "The algorithm it predicts fastest to the target, by link speed and ranks:\n\n")
    by_rate: dict[Any, list[str]] = {}
    ranks: list[Any] = []
    for rec in data.get("recommendation", []):
        by_rate.setdefault(rec["inter_gbit"], []).append(
            f"{rec['best']} ({_fmt(rec['tta_vs_sync'], 2)})")
        if rec["ranks"] not in ranks:
            ranks.append(rec["ranks"])
    rows = [[f"{g} Gbit/s", *cells] for g, cells in by_rate.items()]
    if rows:
        text += _list_table(["link", *[f"{r} ranks" for r in ranks]], rows)
    return text


def _summarise_grid(data: dict) -> str:
    text = (f"Progress file of the time-to-accuracy grid: {len(data.get('done', []))} jobs "
            f"done, {len(data.get('skipped', []))} skipped, {len(data.get('failed', []))} "
            f"failed, in {data.get('pieces')} pieces ({_fmt(data.get('grid_s'))} s of a "
            f"{_fmt(data.get('budget_s'))} s budget).\n")
    return text


_MADE_BY = {
    "collectives": "benchmarks/bench_collectives.py",
    "partition": "benchmarks/bench_partition.py --json",
    "tta": "benchmarks/bench_time_to_accuracy.py --json (the GPT grid: benchmarks/run_tta_gpt.sh)",
    "cost_model": "benchmarks/bench_time_to_accuracy_grid.py (the cost model calibrated on the "
                  "grid's runs: benchmarks/cost_model.py)",
    "grid": "benchmarks/run_tta_gpt.sh (benchmarks/bench_time_to_accuracy_grid.py)",
}


def _kind(data: Any) -> str | None:
    if not isinstance(data, dict):
        return None
    if data.get("benchmark") == "collectives":
        return "collectives"
    if data.get("benchmark") == "bench_partition":
        return "partition"
    if "panels" in data and "target_rule" in data:
        return "tta"
    if "recommendation" in data and "validation" in data:
        return "cost_model"
    if {"done", "skipped", "failed"} <= set(data):
        return "grid"
    return None


def _committed(path: str) -> str:
    """The date and commit of the file's last change (``git log``), or ''."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%cs %h", "--", path],
                             capture_output=True, text=True, timeout=20,
                             cwd=os.path.dirname(path)).stdout.strip()
    except Exception:
        return ""
    return out


def _summarise(data: Any) -> str | None:
    if not isinstance(data, dict):
        return None
    if data.get("benchmark") == "collectives":
        return _summarise_collectives(data)
    if data.get("benchmark") == "bench_partition":
        return _summarise_partition(data)
    if "panels" in data and "target_rule" in data:
        return _summarise_tta(data)
    if "recommendation" in data and "validation" in data:
        return _summarise_cost_model(data)
    if {"done", "skipped", "failed"} <= set(data):
        return _summarise_grid(data)
    return None


class BenchmarksDirective(SphinxDirective):
    """Every ``*.json`` of the results folder, each under its own section title; or, with
    arguments (file names or patterns relative to the folder, e.g. ``tta_gpt_2x1/*.json``),
    only those, each under a rubric (usable inside a page's own sections, e.g. from a MyST
    page's ``{eval-rst}`` block)."""
    has_content = False
    optional_arguments = 1
    final_argument_whitespace = True

    def run(self) -> list[nodes.Node]:
        folder = self.config.commlib_results_dir
        text = ""
        generic = []
        patterns = self.arguments[0].split() if self.arguments else ["*.json"]
        paths = sorted({p for pattern in patterns
                        for p in glob.glob(os.path.join(folder, pattern))})
        if self.arguments and not paths:
            logger.warning("commlib-benchmarks: no result file matches %s", self.arguments[0],
                           location=self.get_location())
        for path in paths:
            self.env.note_dependency(path)
            name = os.path.basename(path)
            try:
                with open(path) as fh:
                    data = json.load(fh)
                body = _summarise(data)
            except Exception as exc:  # a malformed file: listed, not fatal
                data, body = None, None
                logger.info("commlib-benchmarks: %s: %s", name, exc)
            if body is None:
                keys = ", ".join(f"``{k}``" for k in data) if isinstance(data, dict) else \
                    type(data).__name__
                generic.append([f"``{name}``", keys])
                continue
            title = os.path.relpath(path, folder)
            text += (f".. rubric:: {title}\n\n" if self.arguments
                     else f"{title}\n{'-' * len(title)}\n\n")
            made = _MADE_BY.get(_kind(data) or "", "")
            when = _committed(path)
            meta = []
            if made:
                meta.append(f"made by ``{made}``")
            if when:
                meta.append(f"committed {when.split()[0]} (``{when.split()[-1]}``)")
            if meta:
                line = "; ".join(meta)
                text += line[0].upper() + line[1:] + ".\n\n"
            text += f"{body}\n"
            png = os.path.splitext(path)[0] + ".png"
            if os.path.exists(png):
                self.env.note_dependency(png)
                here = os.path.dirname(self.env.doc2path(self.env.docname))
                text += (f".. image:: {os.path.relpath(png, here)}\n   :width: 100%\n"
                         f"   :alt: the plot committed beside {name}\n\n")
        if generic:
            title = "Other result files"
            text += (f".. rubric:: {title}\n\n" if self.arguments
                     else f"{title}\n{'-' * len(title)}\n\n")
            text += _list_table(["file", "top-level keys"], generic)
        return _parse_rst(self, text)


# -- algorithms ---------------------------------------------------------------------------

def _algorithm_class(name: str) -> type:
    from commlib.algorithms import registry
    return registry.lookup(name)


def _canonical(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class AlgorithmDirective(SphinxDirective):
    """The registered class of an algorithm, its knobs, and the cost model's bytes per step
    at its defaults; as nodes (works in MyST pages)."""
    required_arguments = 1
    option_spec = {"ranks": directives.positive_int}

    def run(self) -> list[nodes.Node]:
        name = self.arguments[0]
        try:
            cls = _algorithm_class(name)
        except ValueError as exc:
            logger.warning("commlib-algorithm: %s", exc, location=self.get_location())
            return []
        self.env.note_dependency(inspect.getsourcefile(cls) or "")
        sig = inspect.signature(cls.__init__)
        knobs = []
        for p in list(sig.parameters.values())[1:]:
            knobs.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
        shown = f'algorithm="{name}", ' + ", ".join(knobs) if knobs else f'algorithm="{name}"'
        para = nodes.paragraph()
        para += nodes.strong(text="Knobs: ")
        para += nodes.literal(text=shown)
        para += nodes.Text(" (class ")
        ref = addnodes.pending_xref("", refdomain="py", reftype="class",
                                    reftarget=_canonical(cls), refexplicit=True,
                                    refwarn=True)
        ref += nodes.literal(text=cls.__qualname__, classes=["xref", "py", "py-class"])
        para += ref
        para += nodes.Text(").")
        out = [para]
        defaults = {p.name: p.default for p in list(sig.parameters.values())[1:]
                    if p.default is not p.empty}
        ranks = int(self.options.get("ranks", 8))
        try:
            import cost_model_formulas as formulas  # benchmarks/ (conf.py's sys.path)
            ratio = formulas.bytes_ratio(name, defaults, ranks=ranks) \
                if name in formulas.MODELLED else None
        except Exception as exc:  # the model cannot price these arguments
            logger.info("commlib-algorithm %s: cost model: %s", name, exc)
            ratio = None
        model = nodes.paragraph()
        model += nodes.strong(text="Bytes per step (cost model): ")
        if ratio is None:
            model += nodes.Text("not priced in bytes by benchmarks/cost_model_formulas.py "
                                "(see below).")
        else:
            mean, peak = ratio
            model += nodes.Text(f"{mean:.3g}x a synchronous gradient allreduce's on average, "
                                f"{peak:.3g}x at the heaviest step (these defaults, {ranks} "
                                f"ranks; computed by benchmarks/cost_model_formulas.py "
                                f"bytes_ratio when this page was built).")
        out.append(model)
        return out


class AlgorithmClassesDirective(SphinxDirective):
    has_content = False

    def run(self) -> list[nodes.Node]:
        from commlib.algorithms import available
        text = ""
        for name in available():
            cls = _algorithm_class(name)
            text += f".. rubric:: ``{name}``\n\n"
            text += f".. autoclass:: {_canonical(cls)}\n   :no-members:\n\n"
        return _parse_rst(self, text)


# -- the completeness check ---------------------------------------------------------------

def public_names(module: Any) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    out = []
    for name, obj in vars(module).items():
        if name.startswith("_"):
            continue
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and \
                getattr(obj, "__module__", None) == module.__name__:
            out.append(name)
    return out


def _resolve(fullname: str) -> Any:
    parts = fullname.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except Exception:
            return None
        return obj
    return None


def check_reference(app: Any, env: Any) -> None:
    domain = env.get_domain("py")
    documented = set(domain.objects)
    by_id: set[int] = set()
    for fullname in documented:
        obj = _resolve(fullname)
        if inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj):
            by_id.add(id(obj))
    missing = []
    for modname in app.config.commlib_public_modules:
        module = importlib.import_module(modname)
        if modname not in documented:
            missing.append(modname)
        for name in public_names(module):
            full = f"{modname}.{name}"
            if full in documented:
                continue
            obj = getattr(module, name, None)
            if (inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj)) \
                    and id(obj) in by_id:
                continue
            missing.append(full)
    for full in missing:
        logger.warning("public name %s is missing from the API reference (docs/reference)",
                       full, type="commlib", subtype="reference")


# -- references to commlib internals ------------------------------------------------------

def _exists(fullname: str) -> bool:
    if not fullname.startswith("commlib"):
        return False
    parts = fullname.split(".")
    for i in range(len(parts), 0, -1):
        modname = ".".join(parts[:i])
        try:
            obj = importlib.import_module(modname)
        except Exception:
            continue
        for attr in parts[i:]:
            if attr in getattr(obj, "__dict__", {}) or attr in getattr(obj, "__all__", ()):
                obj = getattr(obj, attr, None)
            elif inspect.isclass(obj) and hasattr(obj, attr):
                obj = getattr(obj, attr)
            else:
                return False
        return True
    return False


def _loaded_names(target: str) -> bool:
    """Whether some loaded commlib module defines ``target`` (a bare name)."""
    for modname, module in list(sys.modules.items()):
        if modname.startswith("commlib") and module is not None and \
                target in getattr(module, "__dict__", {}):
            return True
    return False


def resolve_internal(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    """References Sphinx could not resolve, in commlib's docstrings.

    * A bare name (``:class:`Pipeline``` in a docstring shown under another module) links
      to the documented object of that name, searched as ``.Pipeline`` would be.
    * A reference to a commlib object that exists but is not in the reference (an internal
      module, a private helper class) is rendered as text, without a warning.
    * A reference to something that does not exist (a typo, a renamed function) keeps its
      warning: nitpicky mode still catches it.
    """
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip(".~")
    module = node.get("py:module") or ""
    cls = node.get("py:class") or ""
    domain = env.get_domain("py")
    typ = node.get("reftype")
    if "." not in target:
        objtypes = domain.objtypes_for_role(typ) or None
        matches = domain.find_obj(env, module, cls, target, None if typ == "obj" else
                                  (typ if objtypes else None), 1)
        matches = [m for m in matches if m[0].startswith("commlib")]
        if matches:
            matches.sort(key=lambda m: (-len(os.path.commonprefix([m[0], module])), m[0]))
            name, obj = matches[0]
            from sphinx.util.nodes import make_refnode
            return make_refnode(app.builder, node.get("refdoc", ""), obj.docname,
                                obj.node_id, contnode, name)
    candidates = [target]
    if module:
        candidates.append(f"{module}.{target}")
        if cls:
            candidates.append(f"{module}.{cls}.{target}")
        # a name relative to a parent package (``:mod:`openmpi``` inside commlib.mpi.mpi_impl)
        parts = module.split(".")
        for i in range(len(parts) - 1, 0, -1):
            candidates.append(".".join(parts[:i]) + "." + target)
    for name in candidates:
        if _exists(name):
            return contnode
    if "." not in target and module.startswith("commlib") and _loaded_names(target):
        return contnode
    return None


_TYPE_RE = re.compile(r"[\w.\[\]|,~`:]+")


def restore_prose(app: Any, what: str, name: str, obj: Any, options: Any,
                  lines: list[str]) -> None:
    """Napoleon reads ``text: more`` on an attribute's or property's first line as a type
    and its description (``:type: text``); commlib's docstrings are prose, so where the
    "type" is not one (``Whether the replicas may differ now: ...``) the line is put back
    as it was. Runs after napoleon."""
    if what not in ("attribute", "property", "data"):
        return
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(":type: "):
            kind = lines[i][len(":type: "):].strip()
            if _TYPE_RE.fullmatch(kind.replace(" | ", "|").replace(", ", ",")):
                return
            del lines[i]
            if i > 0 and not lines[i - 1].strip():
                del lines[i - 1]
            for j, line in enumerate(lines):
                if line.strip():
                    indent = line[:len(line) - len(line.lstrip())]
                    lines[j] = f"{indent}{kind}: {line.lstrip()}"
                    break
            return


_BUILTIN_VALUES = (str, bytes, int, float, bool, tuple, list, dict, set, frozenset)


def drop_type_docstrings(app: Any, what: str, name: str, obj: Any, options: Any,
                         lines: list[str]) -> None:
    """A module constant of a built-in type (``GRADIENTS = "gradients"``) has no docstring
    of its own: autodoc would show ``str``'s or ``dict``'s. The page says what it is."""
    if what in ("data", "attribute") and type(obj) in _BUILTIN_VALUES and \
            lines and (type(obj).__doc__ or "").strip().startswith(lines[0].strip()):
        lines[:] = []


class MappingDirective(SphinxDirective):
    """``.. commlib-mapping:: module.NAME``: a dict constant as a two-column table, read
    when the site is built."""
    required_arguments = 1
    option_spec = {"header": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        modname, _, attr = self.arguments[0].rpartition(".")
        mapping = getattr(importlib.import_module(modname), attr)
        header = [h.strip() for h in self.options.get("header", "key, value").split(",", 1)]
        rows = [[f"``{k}``", str(v)] for k, v in mapping.items()]
        return _parse_rst(self, _list_table(header, rows, "25 75"))


# -- code blocks of the docstrings the reference renders ----------------------------------

def check_docstring_blocks(app: Any, what: str, name: str, obj: Any, options: Any,
                           lines: list[str]) -> None:
    """Record every code block of a docstring autodoc renders, and warn (an error under
    ``-W``) about one that is neither runnable nor marked not runnable
    (``docs/_ext/commlib_docstring_blocks.py``; ``tests/test_docstring_examples.py`` runs
    them). Runs last, on the lines the page shows."""
    env = app.env
    store = env.__dict__.setdefault("commlib_docstring_blocks", {})
    for block in parse_docstring("\n".join(lines), name):
        store.setdefault(env.docname, []).append(
            {"obj": name, "line": block.line, "lang": block.lang, "code": block.code,
             "runs": block.runs, "not_run": block.not_run})
        if block.not_run is None and not block.runs:
            logger.warning("a %s code block in the docstring of %s (its line %d) is neither "
                           "run nor marked: start it with '# run: ...' or '# not run: "
                           "REASON'", block.lang, name, block.line,
                           location=env.docname, type="commlib", subtype="docstring")


def _purge_docstring_blocks(app: Any, env: Any, docname: str) -> None:
    env.__dict__.get("commlib_docstring_blocks", {}).pop(docname, None)


def _merge_docstring_blocks(app: Any, env: Any, docnames: Any, other: Any) -> None:
    store = env.__dict__.setdefault("commlib_docstring_blocks", {})
    for docname, blocks in other.__dict__.get("commlib_docstring_blocks", {}).items():
        if docname in docnames:
            store[docname] = blocks


def write_docstring_blocks(app: Any, exception: Any) -> None:
    """``commlib_docstring_blocks.json`` in the doctree directory: the docstring code blocks
    the site shows (what ``tests/test_docs.py`` compares with the blocks it runs)."""
    if exception is not None:
        return
    store = app.env.__dict__.get("commlib_docstring_blocks", {})
    out = [dict(block, docname=docname) for docname in sorted(store)
           for block in store[docname]]
    with open(os.path.join(app.doctreedir, "commlib_docstring_blocks.json"), "w") as fh:
        json.dump(out, fh, indent=1)


def setup(app: Any) -> dict[str, Any]:
    app.connect("autodoc-process-docstring", drop_type_docstrings)
    app.add_directive("commlib-mapping", MappingDirective)
    app.connect("missing-reference", resolve_internal)
    app.connect("autodoc-process-docstring", restore_prose, priority=600)
    app.add_config_value("commlib_public_modules", [], "env")
    app.add_config_value("commlib_results_dir", "", "env")
    app.add_directive("commlib-options", OptionsDirective)
    app.add_directive("commlib-cli", CliDirective)
    app.add_directive("commlib-benchmarks", BenchmarksDirective)
    app.add_directive("commlib-algorithm", AlgorithmDirective)
    app.add_directive("commlib-algorithm-classes", AlgorithmClassesDirective)
    app.connect("env-check-consistency", check_reference)
    app.connect("autodoc-process-docstring", check_docstring_blocks, priority=700)
    app.connect("env-purge-doc", _purge_docstring_blocks)
    app.connect("env-merge-info", _merge_docstring_blocks)
    app.connect("build-finished", write_docstring_blocks)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
