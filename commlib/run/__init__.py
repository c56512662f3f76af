"""``python -m commlib``: run an unmodified torch DDP script on commlib::

    # not run: the command line's synopsis (docs/reference/cli runs --help)
    mpiexec -n 4 python -m commlib [--algorithm NAME] [--algorithm-config JSON]
                                   [--backend commlib|gloo] train.py ARGS...
    torchrun --nproc-per-node 4 -m commlib [...] train.py ARGS...
    mpiexec -n 4 python -m commlib [...] -m package.module ARGS...

Before the script runs, torch's ``DistributedDataParallel`` becomes commlib's wrapper with
the chosen algorithm, ``init_process_group()`` without a backend uses the chosen backend,
and relaxed algorithms get automatic sync points (see :mod:`commlib.run.patch` and
:mod:`commlib.run.sync`). The script then runs as ``python train.py ARGS...`` would run it:
``__name__ == "__main__"``, ``sys.argv == ["train.py", *ARGS]``, the script's directory
first on ``sys.path``; its exceptions and exit status are the job's.

Options (each also read from the environment when not given):

``--algorithm NAME`` (``COMMLIB_ALGORITHM``, default ``gradient_allreduce``)
    the algorithm of every ``DistributedDataParallel`` the script builds without one.
``--algorithm-config JSON`` (``COMMLIB_ALGORITHM_CONFIG``)
    its keyword arguments as a JSON object, e.g. ``'{"sync_every": 8}'``.
``--backend commlib|gloo`` (``COMMLIB_BACKEND``, default ``commlib``)
    the backend of ``init_process_group()`` calls that name none.
``--no-sync-points`` (``COMMLIB_SYNC_POINTS=0``)
    do not average relaxed replicas automatically.
``--verbose`` (``COMMLIB_RUN_VERBOSE=1``)
    report every sync point with each replica's checksum on stderr.
"""
from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Callable, Sequence

from .config import BACKENDS, Config, check_backend, parse_algorithm_config

USAGE = ("usage: python -m commlib [--algorithm NAME] [--algorithm-config JSON] "
         "[--backend commlib|gloo] [--no-sync-points] [--verbose] "
         "(script.py | -m module) [args ...]")


#: What :func:`install` calls last: the frameworks' preparations, added by the layer that
#: knows them (:mod:`commlib.integrations` adds Accelerate's environment when this module
#: is imported); the runner itself imports no integration.
PREPARE: list[Callable[[], object]] = []


class UsageError(ValueError):
    """A bad command line (reported with the usage, exit status 2)."""


def parse(argv: Sequence[str]) -> tuple[Config, str | None, str | None, list[str]]:
    """``(config, script, module, script_args)`` from the runner's arguments: options up
    to the first argument that is not one (the script), everything after it is the
    script's."""
    config = Config.from_environment()
    args = list(argv)
    i = 0

    def value(option: str) -> str:
        nonlocal i
        if "=" in args[i]:
            return args[i].split("=", 1)[1]
        if i + 1 >= len(args):
            raise UsageError(f"{option} needs a value")
        i += 1
        return args[i]

    while i < len(args):
        arg = args[i]
        name = arg.split("=", 1)[0]
        if arg == "--":
            i += 1
            break
        if name == "--algorithm":
            config.algorithm = value(name)
        elif name == "--algorithm-config":
            config.algorithm_config = parse_algorithm_config(value(name))
        elif name == "--backend":
            config.backend = check_backend(value(name))
        elif arg == "--no-sync-points":
            config.sync_points = False
        elif arg == "--verbose":
            config.verbose = True
        elif arg in ("-h", "--help"):
            raise UsageError("")
        elif arg == "-m":
            if i + 1 >= len(args):
                raise UsageError("-m needs a module name")
            return config, None, args[i + 1], args[i + 2:]
        elif arg.startswith("-"):
            raise UsageError(f"unknown option {arg!r}")
        else:
            break
        i += 1
    if i >= len(args):
        raise UsageError("no script given")
    return config, args[i], None, args[i + 1:]


def check_algorithm(config: Config) -> None:
    """Build the algorithm once, so that an unknown name or keyword fails on every rank
    before the script starts (``ValueError``/``TypeError`` naming it)."""
    from ..ddp.arguments import make_algorithm
    make_algorithm(config.algorithm, dict(config.algorithm_config))


def install(config: Config | None = None) -> Config:
    """Apply the runner's changes to torch in this process (what ``python -m commlib``
    does before the script runs); ``config`` defaults to the environment's
    (``COMMLIB_ALGORITHM``...). As the first line of a script, ``import commlib.run;
    commlib.run.install()`` gives it the runner's behaviour without the runner (the
    end-of-script sync point is the runner's own; the others apply). Returns the config."""
    from . import patch
    config = Config.from_environment() if config is None else config
    check_algorithm(config)
    config.export()
    patch.install(config)
    for prepare in PREPARE:
        prepare()
    return config


def run(script: str | None, module: str | None, script_args: Sequence[str]) -> None:
    """Run the script (or module) as ``__main__``, then the end-of-training sync point if it
    ended cleanly. Exceptions and ``SystemExit`` propagate."""
    import gc

    from . import sync
    clean = False
    try:
        if module is not None:
            sys.argv = [module, *script_args]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            path = os.path.abspath(script)  # type: ignore[arg-type]
            sys.argv = [script, *script_args]  # type: ignore[list-item]
            sys.path[0] = os.path.dirname(path)  # as `python script.py` sets it
            runpy.run_path(path, run_name="__main__")
        clean = True
    except SystemExit as exc:
        clean = exc.code in (None, 0)
        gc.collect()  # the script's unreachable wrappers close now, on every rank alike
        sync.end_of_training(clean, "end of script", leaving=True)
        raise
    gc.collect()
    sync.end_of_training(clean, "end of script", leaving=True)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``python -m commlib`` command: 2 for a bad command line (an unknown option,
    algorithm or algorithm argument, a script that does not exist), else what the script
    exits with."""
    try:
        config, script, module, script_args = parse(sys.argv[1:] if argv is None else argv)
        check_algorithm(config)
        if script is not None and not os.path.isfile(script):
            raise UsageError(f"can't open file {script!r}: no such file")
    except (UsageError, ValueError, TypeError) as exc:
        message = str(exc)
        print(USAGE + ("" if not message else f"\npython -m commlib: error: {message}"),
              file=sys.stderr)
        if not message:
            print(__doc__, file=sys.stderr)
            return 0
        return 2
    install(config)
    run(script, module, script_args)
    return 0


__all__ = ["BACKENDS", "Config", "install", "main", "parse", "run"]
