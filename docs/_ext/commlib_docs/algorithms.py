"""``.. commlib-algorithm:: NAME`` and ``.. commlib-algorithm-classes::``: the registered
DDP algorithms' classes and knobs.
"""
from __future__ import annotations

import inspect

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx import addnodes
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

from .rst import _parse_rst

logger = logging.getLogger(__name__)


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
