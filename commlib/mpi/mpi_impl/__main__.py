"""``python -m commlib.mpi.mpi_impl``: the MPI implementation's facts, or its ``mpiexec``
options (see :mod:`commlib.mpi.mpi_impl`)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commlib.mpi.mpi_impl")
    parser.add_argument("--json", action="store_true", help="every fact as JSON")
    parser.add_argument("--launch", type=int, metavar="N",
                        help="print mpiexec's options for N ranks, one per line")
    parser.add_argument("--fault-tolerant", action="store_true",
                        help="with --launch: the options fault-tolerant mode needs")
    parser.add_argument("--launch-env", action="store_true",
                        help="print the launcher's environment as KEY=VALUE lines")
    parser.add_argument("--shm-prefixes", action="store_true",
                        help="print the name prefixes of its /dev/shm files, one per line")
    args = parser.parse_args(argv)
    from . import current
    impl = current()
    if args.launch is not None:
        try:
            print("\n".join(impl.launch_args(args.launch, args.fault_tolerant)))
        except ValueError as exc:
            print(f"python -m commlib.mpi.mpi_impl: {exc}", file=sys.stderr)
            return 2
    elif args.shm_prefixes:
        print("\n".join(impl.shm_prefixes))
    elif args.launch_env:
        print("\n".join(f"{k}={v}" for k, v in impl.launch_env().items()))
    elif args.json:
        print(json.dumps(dataclasses.asdict(impl), indent=1))
    else:
        print(f"{impl.describe()} (key {impl.key}, {impl.abi} ABI)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
