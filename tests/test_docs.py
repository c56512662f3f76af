"""The documentation site (``docs/``) and the README: the site builds with warnings as
errors and nitpicky references, and every code block of its pages and of ``README.md`` is
run or says why it is not.

Code blocks are fences (```` ```python ````, ```` ```bash ````, ...) in ``docs/**/*.md``,
``README.md`` and ``CHANGELOG.md`` (the site's changelog page includes it); MyST directives
(```` ```{toctree} ````, ```` ```{commlib-algorithm} ````) are not code. The first line of a
block says how it runs:

* ``python`` with no marker: ``python snippet.py`` in a fresh directory;
* ``# run: mpiexec -n 2`` (optionally ``VAR=value ...`` before ``mpiexec``, and
  ``-disable-auto-cleanup`` for fault-tolerant mode): under this environment's mpiexec with
  the implementation's options (``tests/helpers.py``);
* ``# run: bash`` (shell blocks): ``bash -e`` in a fresh directory, this environment's
  ``bin`` first on ``PATH`` and ``mpiexec`` given the implementation's options;
* ``# not run: REASON``: not runnable here (a GPU, Slurm, several hosts, a fresh venv);
  counted and reported as a skip with the reason. Where a first-line comment cannot be
  written (a ``diff``, a script's ``#!`` line, a block CI extracts byte for byte), an HTML
  comment ``<!-- not run: REASON -->`` on the lines just above the fence says the same.

A block in another language without a marker fails ``test_every_block_is_run_or_marked``: a
code block is either executed or says why not. A block that fails, or outlives its timeout,
fails the test. The negative controls feed a broken snippet to the same runner.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import clean_env, mpi_impl, mpiexec, mpiexec_cmd, serial_only

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 200
BUILD_TIMEOUT_S = 300
SNIPPET_TIMEOUT_S = 120

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
_RUN = re.compile(r"^#\s*run:\s*(?P<how>.+)$")
_NOT_RUN = re.compile(r"^#\s*not run:\s*(?P<why>.+)$")
_HTML_NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<why>.+?)\s*-->\s*$")
_HTML_COMMENT = re.compile(r"^\s*<!--.*-->\s*$")
PYTHON = ("python", "py", "python3")
SHELL = ("bash", "sh", "shell", "console")


@dataclass
class Snippet:
    page: str          # path relative to the repository root
    line: int          # line of the opening fence (1-based)
    code: str
    lang: str = "python"
    launch: str | None = None     # the text after "# run:", None: one process
    not_run: str | None = None    # the reason, when not runnable here

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        """Executed by :func:`test_snippet_runs`."""
        if self.not_run is not None:
            return False
        return self.lang in PYTHON or (self.lang in SHELL and self.launch == "bash")


def _html_reason(lines: list[str], fence: int) -> str | None:
    """The reason of an ``<!-- not run: ... -->`` among the comment lines just above a
    fence (blank lines between them allowed)."""
    i = fence - 1
    while i >= 0 and (not lines[i].strip() or _HTML_COMMENT.match(lines[i])):
        m = _HTML_NOT_RUN.match(lines[i])
        if m:
            return m["why"].strip()
        i -= 1
    return None


def parse_snippets(text: str, page: str) -> list[Snippet]:
    """The fenced code blocks of a Markdown (MyST) page, in every language; directives
    (an info string in braces other than ``{code-block}``/``{code}``) are left out."""
    out: list[Snippet] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        start = i
        body = []
        i += 1
        while i < len(lines):
            close = lines[i].strip()
            if close.startswith(fence[0] * len(fence)) and not close.strip(fence[0]):
                break
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else
                        lines[i].lstrip())
            i += 1
        i += 1
        words = info.split()
        lang = words[0] if words else ""
        if lang.startswith("{"):
            if lang.strip("{}") not in ("code-block", "code", "sourcecode"):
                continue                      # a directive, not code
            lang = words[1] if len(words) > 1 else ""
        snip = Snippet(page, start + 1, "\n".join(body) + "\n", lang=lang)
        first = body[0].strip() if body else ""
        if (mr := _RUN.match(first)):
            snip.launch = mr["how"].strip()
        elif (mn := _NOT_RUN.match(first)):
            snip.not_run = mn["why"].strip()
        elif (why := _html_reason(lines, start)) is not None:
            snip.not_run = why
        out.append(snip)
    return out


def pages() -> list[Path]:
    """Every Markdown file whose code blocks are checked: the site's pages, the README and
    the changelog the site includes."""
    site = [p for p in sorted(DOCS.rglob("*.md")) if "_build" not in p.parts]
    return site + [README, ROOT / "CHANGELOG.md"]


def all_snippets() -> list[Snippet]:
    out: list[Snippet] = []
    for path in pages():
        if path.exists():
            out += parse_snippets(path.read_text(), str(path.relative_to(ROOT)))
    return out


def unmarked(snippets: list[Snippet]) -> list[Snippet]:
    """Blocks that are neither run nor marked not runnable (a shell, toml, diff... block
    without a marker, or a ``# run:`` its language cannot take)."""
    return [s for s in snippets if s.not_run is None and not s.runs]


def launch_command(launch: str | None, script: str,
                   lang: str = "python") -> tuple[list[str], dict[str, str]]:
    """The command and extra environment of a snippet: ``None`` is one process;
    ``bash`` a shell block; else ``[VAR=value ...] mpiexec [-disable-auto-cleanup] -n N``."""
    if lang in SHELL:
        if launch != "bash":
            raise ValueError(f"'# run: {launch}': a shell block runs as '# run: bash'")
        return ["bash", "-e", script], {}
    if launch is None:
        return [sys.executable, script], {}
    words = shlex.split(launch)
    env: dict[str, str] = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if not words or words[0] != "mpiexec":
        raise ValueError(f"'# run: {launch}': expected [VAR=value ...] mpiexec ... -n N")
    words.pop(0)
    fault_tolerant = False
    n = None
    while words:
        word = words.pop(0)
        if word == "-disable-auto-cleanup":
            fault_tolerant = True
        elif word in ("-n", "-np") and words:
            n = int(words.pop(0))
        else:
            raise ValueError(f"'# run: {launch}': unknown launcher option {word!r}")
    if n is None:
        raise ValueError(f"'# run: {launch}': no -n N")
    return mpiexec_cmd(n, fault_tolerant=fault_tolerant) + [sys.executable, script], env


def _shell_prelude() -> str:
    """Run before a shell block: this environment's ``bin`` first on ``PATH`` (``python``,
    ``commlib-info``, ``mpiexec``), and ``mpiexec`` with the implementation's options."""
    extra = [a for a in mpi_impl().launch_args(2)[:-2]]     # launch_args ends with -n 2
    bindir = os.path.dirname(sys.executable)
    return (f"export PATH={shlex.quote(bindir)}:\"$PATH\"\n"
            f"mpiexec() {{ command {shlex.quote(mpiexec())} "
            f"{' '.join(shlex.quote(a) for a in extra)} \"$@\"; }}\n")


def run_snippet(code: str, launch: str | None = None, timeout: float = SNIPPET_TIMEOUT_S,
                lang: str = "python") -> tuple[int, float, str]:
    """Run one snippet in a fresh directory: (exit status, seconds, output); -9 when it
    outlived ``timeout`` (its process group is killed)."""
    with tempfile.TemporaryDirectory(prefix="commlib-doc-") as tmp:
        shell = lang in SHELL
        script = os.path.join(tmp, "snippet.sh" if shell else "snippet.py")
        with open(script, "w") as fh:
            fh.write((_shell_prelude() + code) if shell else code)
        cmd, extra = launch_command(launch, script, lang)
        env = clean_env(OMP_NUM_THREADS="1", COMMLIB_TIMEOUT="60", **extra)
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
            code_ = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate()
            code_ = -9
        return code_, time.monotonic() - start, out


SNIPPETS = all_snippets()


def _tally(snippets: list[Snippet]) -> str:
    run = [s for s in snippets if s.runs]
    marked = [s for s in snippets if s.not_run is not None]
    mpi = sum(s.launch is not None and s.launch != "bash" for s in run)
    return (f"{len(snippets)} code blocks, {len(run)} run ({mpi} under mpiexec, "
            f"{sum(s.launch == 'bash' for s in run)} shell), {len(marked)} marked not "
            f"runnable")


def test_snippets_are_found_and_marked():
    """Every Python block is runnable or says why not; the count, for the site and the
    README apart, is reported."""
    assert len(SNIPPETS) >= 15, [s.id for s in SNIPPETS]
    for s in SNIPPETS:
        if s.launch is not None:
            launch_command(s.launch, "x.py", s.lang)   # raises on a malformed marker
        assert s.not_run is None or len(s.not_run) > 5, s.id
    readme = [s for s in SNIPPETS if s.page == "README.md"]
    site = [s for s in SNIPPETS if s.page != "README.md"]
    assert any(s.runs for s in readme), "the README's example is not run"
    marked = [s for s in SNIPPETS if s.not_run is not None]
    print(f"\nREADME: {_tally(readme)}\nsite: {_tally(site)}\nnot runnable: "
          + "; ".join(f"{s.id} ({s.not_run})" for s in marked))


def test_every_block_is_run_or_marked():
    """No code block is left unexecuted without saying why."""
    assert not unmarked(SNIPPETS), [f"{s.id} ({s.lang or 'no language'})"
                                    for s in unmarked(SNIPPETS)]


def test_unmarked_block_is_caught():
    """Negative control of the check above: a bare shell block, a ``# run:`` on toml, and
    an HTML comment that is not a marker are reported; the markers are not."""
    text = ("```bash\nsrun python train.py\n```\n\n```toml\n# run: mpiexec -n 2\nx = 1\n```\n"
            "\n<!-- just a comment -->\n```diff\n-a\n+b\n```\n\n"
            "<!-- not run: needs Slurm -->\n```bash\nsrun python train.py\n```\n\n"
            "```bash\n# not run: several hosts\nmpiexec -hosts a,b python t.py\n```\n\n"
            "```bash\n# run: bash\necho ok\n```\n")
    got = parse_snippets(text, "t.md")
    assert [s.line for s in unmarked(got)] == [1, 5, 11]
    assert [s.not_run for s in got[3:5]] == ["needs Slurm", "several hosts"]
    assert got[5].runs


def test_readme_fits_two_screens():
    """The README stays short (under 200 lines) and still opens with the two commands CI
    extracts (``<!-- ci:main -->``, ``<!-- ci:test -->``), each followed by a bash block."""
    lines = README.read_text().splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md has {len(lines)} lines"
    for marker in ("<!-- ci:main -->", "<!-- ci:test -->"):
        i = lines.index(marker)
        assert lines[i + 1] == "```bash" and lines[i + 3] == "```", marker
    print(f"\nREADME.md: {len(lines)} lines")


def test_readme_links_resolve():
    """Every relative link of the README names a file of the repository."""
    text = README.read_text()
    links = re.findall(r"\]\((?!https?://|#)([^)#\s]+)", text)
    assert links
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, missing


@serial_only
@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_snippet_runs(snippet: Snippet):
    if snippet.not_run is not None:
        pytest.skip(f"not run: {snippet.not_run}")
    if not snippet.runs:
        pytest.fail(f"{snippet.id}: a {snippet.lang!r} block with no marker")
    status, took, out = run_snippet(snippet.code, snippet.launch, lang=snippet.lang)
    assert status == 0, (f"{snippet.id} ({snippet.launch or 'one process'}) exited with "
                         f"{status} after {took:.1f} s:\n{out[-4000:]}")


@serial_only
def test_negative_control_broken_snippets_fail():
    """The runner fails what is broken: an exception in one process, one rank of two
    raising, a failing shell line, and a snippet that hangs past its timeout."""
    status, _, out = run_snippet("import commlib\nraise SystemExit(commlib.nope)\n")
    assert status != 0 and "nope" in out, out
    status, _, out = run_snippet(
        "# run: mpiexec -n 2\nimport numpy as np, commlib\ncommlib.init()\n"
        "x = np.ones(3)\ncommlib.allreduce(x)\n"
        "if commlib.get_rank() == 1:\n    raise RuntimeError('rank 1 broke')\n"
        "commlib.barrier()\n", "mpiexec -n 2")
    assert status != 0 and "rank 1 broke" in out, out
    status, _, out = run_snippet("# run: bash\nfalse\necho not reached\n", "bash",
                                 lang="bash")
    assert status != 0 and "not reached" not in out, out
    status, _, _ = run_snippet("import time\ntime.sleep(60)\n", timeout=3)
    assert status == -9


def test_snippet_parser_markers():
    text = ("# T\n\n```python\n# run: COMMLIB_FAULT_TOLERANT=1 mpiexec -disable-auto-cleanup "
            "-n 2\nx = 1\n```\n\n- item\n\n  ```python\n  # not run: needs Slurm\n  y = 2\n"
            "  ```\n\n```bash\necho no\n```\n\n````python\nz = '```'\n````\n\n"
            "```{toctree}\nintro\n```\n\n```{code-block} python\nw = 3\n```\n")
    got = parse_snippets(text, "t.md")
    assert [(s.line, s.lang, s.launch, s.not_run) for s in got] == [
        (3, "python", "COMMLIB_FAULT_TOLERANT=1 mpiexec -disable-auto-cleanup -n 2", None),
        (10, "python", None, "needs Slurm"), (15, "bash", None, None),
        (19, "python", None, None), (27, "python", None, None)]
    assert got[1].code == "# not run: needs Slurm\ny = 2\n"
    cmd, env = launch_command(got[0].launch, "s.py")
    assert env == {"COMMLIB_FAULT_TOLERANT": "1"} and cmd[-2:] == [sys.executable, "s.py"]
    with pytest.raises(ValueError):
        launch_command("srun -n 2", "s.py")
    with pytest.raises(ValueError):
        launch_command("mpiexec -n 2", "s.sh", "bash")
    assert launch_command("bash", "s.sh", "bash")[0] == ["bash", "-e", "s.sh"]


def _have_sphinx() -> str | None:
    for module in ("sphinx", "myst_parser", "furo", "sphinx_copybutton"):
        if importlib.util.find_spec(module) is None:
            return module
    return None


@serial_only
def test_site_builds_without_warnings(tmp_path):
    """``sphinx-build -W -n --keep-going``: warnings (nitpicky references, a public name
    missing from the reference, a generated page that fails) are errors. Built into a
    temporary directory: nothing is left in the tree."""
    missing = _have_sphinx()
    if missing:
        pytest.skip(f"{missing} is not installed (pip install -e '.[docs]')")
    out_dir = tmp_path / "html"
    before = _untracked_in_docs()
    cmd = [sys.executable, "-m", "sphinx", "-W", "-n", "--keep-going", "-j", "1", "-q",
           "-b", "html", "-d", str(tmp_path / "doctrees"), str(DOCS), str(out_dir)]
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                          env=clean_env(OMP_NUM_THREADS="1"), cwd=tmp_path)
    took = time.monotonic() - start
    assert done.returncode == 0, (f"sphinx-build exited with {done.returncode} after "
                                  f"{took:.0f} s:\n{done.stderr[-6000:]}")
    assert (out_dir / "index.html").is_file()
    for page in ("reference/options.html", "reference/cli.html", "benchmarks/index.html"):
        assert (out_dir / page).is_file(), page
    options = (out_dir / "reference/options.html").read_text()
    assert "COMMLIB_TIMEOUT" in options and "COMMLIB_SHM" in options
    assert _untracked_in_docs() == before, "the build left files in docs/"
    print(f"\ndocs build: {took:.1f} s")
    _check_docstring_blocks_are_walked(tmp_path / "doctrees" / "commlib_docstring_blocks.json")


def _norm(code: str) -> str:
    return "\n".join(line.strip() for line in code.strip().splitlines())


def _check_docstring_blocks_are_walked(recorded: Path) -> None:
    """Every docstring code block the build rendered (the extension records them) is one
    ``tests/test_docstring_examples.py`` runs or counts as marked: its walk of the
    reference misses none."""
    import json

    from test_docstring_examples import BLOCKS
    rendered = json.loads(recorded.read_text())
    walked = {_norm(b.code) for b in BLOCKS}
    missed = [f"{r['docname']}: {r['obj']} (line {r['line']})" for r in rendered
              if _norm(r["code"]) not in walked]
    assert not missed, f"docstring blocks on the site that the tests do not see: {missed}"
    shown = {_norm(r["code"]) for r in rendered}
    print(f"{len(shown)} distinct docstring code blocks on the site, all among the "
          f"{len(BLOCKS)} of tests/test_docstring_examples.py")


@serial_only
def test_external_references_are_checked(tmp_path):
    """With the committed inventories (``docs/_inventories``), references into Python,
    numpy and mpi4py resolve to their sites, and a wrong one fails the nitpicky build
    (negative control: a misspelled name in each); torch's, without an inventory, stay
    plain text. A two-page site with ``docs/conf.py``'s intersphinx and nitpick settings."""
    missing = _have_sphinx()
    if missing:
        pytest.skip(f"{missing} is not installed (pip install -e '.[docs]')")
    for name in ("python", "numpy", "mpi4py"):
        assert (DOCS / "_inventories" / f"{name}.inv").is_file(), name
    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text(
        f"import runpy\n_conf = runpy.run_path({str(DOCS / 'conf.py')!r})\n"
        "extensions = ['sphinx.ext.intersphinx']\n"
        "intersphinx_mapping = _conf['intersphinx_mapping']\n"
        "nitpicky = True\nnitpick_ignore_regex = _conf['nitpick_ignore_regex']\n")
    good = (":class:`numpy.ndarray`, :func:`os.getpid`, :class:`mpi4py.MPI.Comm`, "
            ":class:`torch.Tensor`")
    bad = ["numpy.no_such_function", "os.no_such_function", "mpi4py.MPI.NoSuchComm"]

    def build(text: str) -> tuple[subprocess.CompletedProcess, str]:
        (src / "index.rst").write_text(f"Title\n=====\n\n{text}\n")
        out = tmp_path / "html"
        done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "-n", "--keep-going",
                               "-q", "-E", "-b", "html", str(src), str(out)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        page = (out / "index.html").read_text() if (out / "index.html").exists() else ""
        return done, page

    done, page = build(good)
    assert done.returncode == 0, done.stderr[-3000:]
    for site in ("numpy.org/doc/stable/reference/generated/numpy.ndarray.html",
                 "docs.python.org/3.11/library/os.html#os.getpid",
                 "mpi4py.readthedocs.io/en/stable/reference/mpi4py.MPI.Comm.html"):
        assert site in page, site
    assert "pytorch.org" not in page
    done, _ = build(", ".join(f":func:`{name}`" for name in bad))
    assert done.returncode != 0
    for name in bad:
        assert f"py:func reference target not found: {name}" in done.stderr, done.stderr


def _untracked_in_docs() -> set[str] | None:
    """Files under docs/ that git neither tracks nor ignores (None without git)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--",
                              "docs"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return {line[3:] for line in out.stdout.splitlines() if line.startswith("??")}


def _extension():
    missing = _have_sphinx()
    if missing:
        pytest.skip(f"{missing} is not installed (pip install -e '.[docs]')")
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import commlib_docs
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    return commlib_docs


def test_reference_check_catches_a_missing_name(monkeypatch):
    """Negative control of the build's completeness check: with one public name of
    ``commlib.algorithms`` left out of the documented objects, it warns (an error under
    ``-W``) naming it; documented under another public name (a re-export) is enough."""
    ext = _extension()
    import commlib.algorithms as algorithms

    class Domain:
        objects = {"commlib.algorithms": None, "commlib.algorithms.get": None,
                   "commlib.register_elsewhere": None}

    class Env:
        def get_domain(self, name):
            return Domain()

    class App:
        class config:
            commlib_public_modules = ["commlib.algorithms"]

    warned = []
    monkeypatch.setattr(ext.reference.logger, "warning",
                        lambda msg, *args, **kw: warned.append(args[0]))
    monkeypatch.setattr(ext.reference, "_resolve", lambda name: algorithms.register
                        if name == "commlib.register_elsewhere" else None)
    ext.reference.check_reference(App(), Env())
    assert "commlib.algorithms.available" in warned
    assert "commlib.algorithms.get" not in warned          # documented as itself
    assert "commlib.algorithms.register" not in warned     # the same object, another name
    assert set(warned) == {f"commlib.algorithms.{n}" for n in algorithms.__all__} - {
        "commlib.algorithms.get", "commlib.algorithms.register"}


def test_build_catches_an_unmarked_docstring_block(monkeypatch):
    """Negative control of the build's docstring check: a shell block without a marker in
    a docstring autodoc renders is a warning (an error under ``-W``); a marked one and a
    Python one are recorded, not warned about."""
    ext = _extension()
    warned = []
    monkeypatch.setattr(ext.docstring_examples.logger, "warning",
                        lambda msg, *args, **kw: warned.append(args))

    class Env:
        docname = "reference/api/x"

    class App:
        env = Env()

    lines = ("Launch::\n\n    # not run: needs Slurm\n    srun python t.py\n\n"
             ".. code-block:: bash\n\n   srun python t.py\n\nExample::\n\n    x = 1\n"
             ).splitlines()
    ext.docstring_examples.check_docstring_blocks(App(), "function", "commlib.f", None, None, lines)
    assert warned == [("bash", "commlib.f", 8)]
    recorded = App.env.commlib_docstring_blocks["reference/api/x"]
    assert [(r["lang"], r["runs"], r["not_run"]) for r in recorded] == [
        ("python", False, "needs Slurm"), ("bash", False, None), ("python", True, None)]


def test_internal_references_must_exist():
    """References to commlib objects outside the reference render as text only when the
    object exists: a typo still fails the nitpicky build."""
    ext = _extension()
    assert ext.resolution._exists("commlib.primitives.node_shm")
    assert ext.resolution._exists("commlib.algorithms.base.Algorithm.on_bucket_ready")
    assert not ext.resolution._exists("commlib.primitives.no_such_module")
    assert not ext.resolution._exists("commlib.algorithms.base.Algorithm.no_such_hook")
    assert not ext.resolution._exists("numpy.ndarray")


def test_benchmark_results_are_summarised_or_listed():
    """Every result file gets a table on the benchmarks page; a schema the page does not
    know falls back to a row with its top-level keys (negative control: a made-up one)."""
    import json
    ext = _extension()
    files = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    assert files
    for path in files:
        data = json.loads(path.read_text())
        summary = ext.benchmark_summaries._summarise(data)
        assert summary is None or summary.strip(), path.name
    assert ext.benchmark_summaries._summarise({"made": "up", "schema": [1, 2]}) is None
    assert ext.benchmark_summaries._summarise([1, 2, 3]) is None
