"""``commlib-horovodrun``: Horovod's ``horovodrun`` command line mapped onto ``mpiexec``.

    commlib-horovodrun -np 4 python train.py ARGS...
    commlib-horovodrun -np 4 -H host1:2,host2:2 python train.py ARGS...
    commlib-horovodrun -np 4 --hostfile hosts.txt python train.py ARGS...

``-np``/``--num-proc`` becomes ``-n``; ``-H``/``--hosts`` becomes MPICH's ``-hosts``
(``host:slots`` entries as Horovod writes them); ``--hostfile`` (Horovod's ``host
slots=N`` lines) becomes ``-f`` with a machine file of ``host:N`` lines;
``--verbose`` prints the command; the other options of ``horovodrun`` that only its own
launcher knows (``--gloo``, elastic ones) are refused. ``MPIEXEC`` names the launcher
(default: ``mpiexec`` on ``PATH``). The exit status is mpiexec's.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commlib-horovodrun",
                                description="horovodrun's command line, run by mpiexec")
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True)
    p.add_argument("-H", "--hosts", dest="hosts")
    p.add_argument("-hostfile", "--hostfile", dest="hostfile")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--mpi", action="store_true", help="accepted: always MPI")
    p.add_argument("command", nargs=argparse.REMAINDER)
    return p


def _hostfile(path: str) -> str:
    """Horovod's ``host slots=N`` lines as an MPICH machine file (``host:N``)."""
    lines = []
    with open(path, encoding="utf-8") as f:
        for raw in f:
            words = raw.split("#", 1)[0].split()
            if not words:
                continue
            slots = next((w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")), "1")
            lines.append(f"{words[0]}:{slots}")
    fd, out = tempfile.mkstemp(prefix="commlib-horovodrun-", suffix=".hosts")
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    return out


def command(argv: list) -> list:
    """The mpiexec command line for ``argv`` (horovodrun's arguments)."""
    args = _parser().parse_args(argv)
    if args.np <= 0:
        raise SystemExit("commlib-horovodrun: -np must be a positive number of processes")
    if not args.command:
        raise SystemExit("commlib-horovodrun: no command to run (e.g. python train.py)")
    cmd = [os.environ.get("MPIEXEC") or shutil.which("mpiexec") or "mpiexec", "-n", str(args.np)]
    if args.hosts:
        cmd += ["-hosts", args.hosts]
    if args.hostfile:
        cmd += ["-f", _hostfile(args.hostfile)]
    return cmd + list(args.command)


def main(argv: list | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd = command(argv)
    if "--verbose" in argv:
        print(" ".join(cmd), file=sys.stderr)
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
