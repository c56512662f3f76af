"""The documentation site (``docs/``): it builds with warnings as errors and nitpicky
references, and every Python code block of its pages runs.

Code blocks are MyST fences (```` ```python ````) in ``docs/**/*.md``. The first line of a
block says how it runs:

* no marker: ``python snippet.py`` in a fresh directory;
* ``# run: mpiexec -n 2`` (optionally ``VAR=value ...`` before ``mpiexec``, and
  ``-disable-auto-cleanup`` for fault-tolerant mode): under this environment's mpiexec with
  the implementation's options (``tests/helpers.py``);
* ``# not run: REASON``: not runnable here (a GPU, Slurm, a cluster); counted and reported
  as a skip with the reason.

A block that fails, or outlives its timeout, fails the test. The negative controls feed a
broken snippet to the same runner.
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

from helpers import clean_env, mpiexec_cmd, serial_only

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BUILD_TIMEOUT_S = 300
SNIPPET_TIMEOUT_S = 120

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
_RUN = re.compile(r"^#\s*run:\s*(?P<how>.+)$")
_NOT_RUN = re.compile(r"^#\s*not run:\s*(?P<why>.+)$")


@dataclass
class Snippet:
    page: str          # path relative to docs/
    line: int          # line of the opening fence (1-based)
    code: str
    launch: str | None = None     # the text after "# run:", None: one process
    not_run: str | None = None    # the reason, when not runnable here

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def parse_snippets(text: str, page: str) -> list[Snippet]:
    """The ``python`` fenced blocks of a MyST page."""
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
        lang = info.split()[0] if info else ""
        if lang.strip("{}") in ("code-block", "code") and len(info.split()) > 1:
            lang = info.split()[1]
        if lang not in ("python", "py", "python3"):
            continue
        snip = Snippet(page, start + 1, "\n".join(body) + "\n")
        first = body[0].strip() if body else ""
        if (mr := _RUN.match(first)):
            snip.launch = mr["how"].strip()
        elif (mn := _NOT_RUN.match(first)):
            snip.not_run = mn["why"].strip()
        out.append(snip)
    return out


def all_snippets() -> list[Snippet]:
    out: list[Snippet] = []
    for path in sorted(DOCS.rglob("*.md")):
        if "_build" in path.parts:
            continue
        out += parse_snippets(path.read_text(), str(path.relative_to(DOCS)))
    return out


def launch_command(launch: str | None, script: str) -> tuple[list[str], dict[str, str]]:
    """The command and extra environment of a snippet: ``None`` is one process; else
    ``[VAR=value ...] mpiexec [-disable-auto-cleanup] -n N``."""
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


def run_snippet(code: str, launch: str | None = None,
                timeout: float = SNIPPET_TIMEOUT_S) -> tuple[int, float, str]:
    """Run one snippet in a fresh directory: (exit status, seconds, output); -9 when it
    outlived ``timeout`` (its process group is killed)."""
    with tempfile.TemporaryDirectory(prefix="commlib-doc-") as tmp:
        script = os.path.join(tmp, "snippet.py")
        with open(script, "w") as fh:
            fh.write(code)
        cmd, extra = launch_command(launch, script)
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


def test_snippets_are_found_and_marked():
    """Every Python block is runnable or says why not; the count is reported."""
    assert len(SNIPPETS) >= 15, [s.id for s in SNIPPETS]
    for s in SNIPPETS:
        if s.launch is not None:
            launch_command(s.launch, "x.py")   # raises on a malformed marker
        assert s.not_run is None or len(s.not_run) > 5, s.id
    run = [s for s in SNIPPETS if s.not_run is None]
    marked = [s for s in SNIPPETS if s.not_run is not None]
    print(f"\ndocs snippets: {len(SNIPPETS)} python blocks, {len(run)} run "
          f"({sum(s.launch is not None for s in run)} under mpiexec), {len(marked)} marked "
          f"not runnable: " + "; ".join(f"{s.id} ({s.not_run})" for s in marked))


@serial_only
@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_snippet_runs(snippet: Snippet):
    if snippet.not_run is not None:
        pytest.skip(f"not run: {snippet.not_run}")
    status, took, out = run_snippet(snippet.code, snippet.launch)
    assert status == 0, (f"{snippet.id} ({snippet.launch or 'one process'}) exited with "
                         f"{status} after {took:.1f} s:\n{out[-4000:]}")


@serial_only
def test_negative_control_broken_snippets_fail():
    """The runner fails what is broken: an exception in one process, one rank of two
    raising, and a snippet that hangs past its timeout."""
    status, _, out = run_snippet("import commlib\nraise SystemExit(commlib.nope)\n")
    assert status != 0 and "nope" in out, out
    status, _, out = run_snippet(
        "# run: mpiexec -n 2\nimport numpy as np, commlib\ncommlib.init()\n"
        "x = np.ones(3)\ncommlib.allreduce(x)\n"
        "if commlib.get_rank() == 1:\n    raise RuntimeError('rank 1 broke')\n"
        "commlib.barrier()\n", "mpiexec -n 2")
    assert status != 0 and "rank 1 broke" in out, out
    status, _, _ = run_snippet("import time\ntime.sleep(60)\n", timeout=3)
    assert status == -9


def test_snippet_parser_markers():
    text = ("# T\n\n```python\n# run: COMMLIB_FAULT_TOLERANT=1 mpiexec -disable-auto-cleanup "
            "-n 2\nx = 1\n```\n\n- item\n\n  ```python\n  # not run: needs Slurm\n  y = 2\n"
            "  ```\n\n```bash\necho no\n```\n\n````python\nz = '```'\n````\n")
    got = parse_snippets(text, "t.md")
    assert [(s.line, s.launch, s.not_run) for s in got] == [
        (3, "COMMLIB_FAULT_TOLERANT=1 mpiexec -disable-auto-cleanup -n 2", None),
        (10, None, "needs Slurm"), (19, None, None)]
    assert got[1].code == "# not run: needs Slurm\ny = 2\n"
    cmd, env = launch_command(got[0].launch, "s.py")
    assert env == {"COMMLIB_FAULT_TOLERANT": "1"} and cmd[-2:] == [sys.executable, "s.py"]
    with pytest.raises(ValueError):
        launch_command("srun -n 2", "s.py")


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
    for page in ("reference/options.html", "reference/cli.html", "benchmarks.html"):
        assert (out_dir / page).is_file(), page
    options = (out_dir / "reference/options.html").read_text()
    assert "COMMLIB_TIMEOUT" in options and "COMMLIB_SHM" in options
    assert _untracked_in_docs() == before, "the build left files in docs/"
    print(f"\ndocs build: {took:.1f} s")


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
    monkeypatch.setattr(ext.logger, "warning", lambda msg, *args, **kw: warned.append(args[0]))
    monkeypatch.setattr(ext, "_resolve", lambda name: algorithms.register
                        if name == "commlib.register_elsewhere" else None)
    ext.check_reference(App(), Env())
    assert "commlib.algorithms.available" in warned
    assert "commlib.algorithms.get" not in warned          # documented as itself
    assert "commlib.algorithms.register" not in warned     # the same object, another name
    assert set(warned) == {f"commlib.algorithms.{n}" for n in algorithms.__all__} - {
        "commlib.algorithms.get", "commlib.algorithms.register"}


def test_internal_references_must_exist():
    """References to commlib objects outside the reference render as text only when the
    object exists: a typo still fails the nitpicky build."""
    ext = _extension()
    assert ext._exists("commlib.primitives.node_shm")
    assert ext._exists("commlib.algorithms.base.Algorithm.on_bucket_ready")
    assert not ext._exists("commlib.primitives.no_such_module")
    assert not ext._exists("commlib.algorithms.base.Algorithm.no_such_hook")
    assert not ext._exists("numpy.ndarray")


def test_benchmark_results_are_summarised_or_listed():
    """Every result file gets a table on the benchmarks page; a schema the page does not
    know falls back to a row with its top-level keys (negative control: a made-up one)."""
    import json
    ext = _extension()
    files = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    assert files
    for path in files:
        data = json.loads(path.read_text())
        summary = ext._summarise(data)
        assert summary is None or summary.strip(), path.name
    assert ext._summarise({"made": "up", "schema": [1, 2]}) is None
    assert ext._summarise([1, 2, 3]) is None
