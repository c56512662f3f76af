"""Runtime options: one object, read from ``COMMLIB_*`` environment variables at import
and settable before or at :func:`commlib.init`.

Like ``mpi4py.rc``, the object rejects unknown names, so a typo fails loudly instead of
being silently ignored. Unknown ``COMMLIB_*`` environment variables produce a warning.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")


def _parse_positive_float(text: Any) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"expected a positive number of seconds, got {text!r}")
    return value


def _parse_local_size(text: Any) -> int | None:
    if text is None or (isinstance(text, str) and text.strip() == ""):
        return None
    value = int(text)
    if value < 1:
        raise ValueError(f"expected a positive number of ranks per node, got {text!r}")
    return value


def _parse_tristate(text: Any) -> str:
    if isinstance(text, bool):
        return "1" if text else "0"
    low = str(text).strip().lower()
    if low in ("auto", ""):
        return "auto"
    return "1" if _parse_bool(low) else "0"


def _parse_wait_poll(text: Any) -> Any:
    if text is None or str(text).strip().lower() in ("auto", ""):
        return "auto"
    value = float(text)
    if not value >= 0:
        raise ValueError(f"expected 'auto' or a number of microseconds >= 0, got {text!r}")
    return value


def _parse_path(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value).strip()
    return text or None


def _as_bool(value: Any) -> bool:
    return _parse_bool(value) if isinstance(value, str) else bool(value)


# name -> (parser, default, environment variable, documentation)
_FIELDS: dict[str, tuple[Callable[[Any], Any], Any, str, str]] = {
    "check": (_as_bool, False, "COMMLIB_CHECK",
              "verify before each collective that all ranks call the same operation with the "
              "same shape, dtype and reduce op"),
    "timeout": (_parse_positive_float, 1800.0, "COMMLIB_TIMEOUT",
                "seconds a blocking collective may wait before the job is aborted"),
    "local_size": (_parse_local_size, None, "COMMLIB_LOCAL_SIZE",
                   "simulate nodes of this many consecutive ranks (hierarchical paths on one "
                   "machine); unset means the real shared-memory topology"),
    "cuda_aware": (_parse_tristate, "auto", "COMMLIB_CUDA_AWARE",
                   "whether GPU buffers go straight to MPI: auto (ask the MPI library), 1 or 0"),
    "exit_window": (_parse_positive_float, 10.0, "COMMLIB_EXIT_WINDOW",
                    "seconds a rank that left the program may still be waited for: a rank "
                    "waiting this long in a collective with it, or a rank that left with a "
                    "non-zero status whose peers did not leave within this time, aborts "
                    "the job (see commlib.core.exits)"),
    "fault_tolerant": (_as_bool, False, "COMMLIB_FAULT_TOLERANT",
                       "fault-tolerant mode: every collective is nonblocking and polled with "
                       "failure detection, a dead peer raises commlib.PeerFailure on every "
                       "survivor, a rank that leaves counts as dead and survivors leave "
                       "through os._exit (see commlib.fault.fault_tolerance, commlib.elastic); "
                       "needs mpiexec -disable-auto-cleanup or the store-backed world"),
    "abort_on_exception": (_as_bool, True, "COMMLIB_ABORT_ON_EXCEPTION",
                           "an uncaught exception on one rank aborts the whole job "
                           "(only when running with more than one rank)"),
    "torch_env": (_as_bool, True, "COMMLIB_TORCH_ENV",
                  "under mpiexec, set torch.distributed's env:// variables (RANK, WORLD_SIZE, "
                  "LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) from MPI at import "
                  "where they are missing"),
    "timeline": (_parse_path, None, "COMMLIB_TIMELINE",
                 "write a Chrome trace of every collective and DDP bucket exchange to "
                 "PATH.rank{r}.json (see commlib.services.timeline); read at commlib.init()"),
    "wait_poll_us": (_parse_wait_poll, "auto", "COMMLIB_WAIT_POLL_US",
                     "how a blocking call waits for MPI: 0 blocks inside MPI (whose wait "
                     "spins on a core), N > 0 tests the operation and sleeps N microseconds "
                     "between tests; auto (the default) polls every 50 us when some host "
                     "runs more ranks than it has cores (a spinning wait there takes the "
                     "core from a rank's compute), else blocks; decided at commlib.init() "
                     "for the whole job (the same on every rank: a collective is started "
                     "blocking on every rank or nonblocking on every rank); no effect in "
                     "fault-tolerant mode, whose waits are its own"),
    "shm": (_parse_tristate, "auto", "COMMLIB_SHM",
            "the shared-memory tier inside a node (commlib.primitives.node_shm) for blocking "
            "allreduce, reduce_scatter, allgather and broadcast of host memory when every "
            "rank of the group is on one node: auto (the default) in the size ranges where "
            "it was measured faster than this MPI implementation's own collectives "
            "(node_shm.AUTO_RANGES; on MPICH allreduce 16 KiB-2 MiB and from 32 MiB, "
            "reduce_scatter from 256 KiB; on Open MPI and Intel MPI allreduce from 32 MiB, "
            "reduce_scatter from 256 KiB and 64 MiB), 1 at any size, 0 never (MPI only); "
            "set it alike on every rank"),
    "force_staging": (_as_bool, False, "COMMLIB_FORCE_STAGING",
                      "route CPU torch tensors through the host staging path used for GPU "
                      "buffers on MPI libraries that are not CUDA-aware (for testing)"),
}

# Read by `python -m commlib` (commlib.run.config), not options.
RUNNER_VARIABLES = ("COMMLIB_ALGORITHM", "COMMLIB_ALGORITHM_CONFIG", "COMMLIB_BACKEND",
                    "COMMLIB_SYNC_POINTS", "COMMLIB_RUN_VERBOSE")
# Read by the launch layer (commlib.mpi.launch.environment, .standby), not options.
LAUNCH_VARIABLES = ("COMMLIB_LAUNCH", "COMMLIB_LAUNCH_PID", "COMMLIB_STORE_STANDBY")


class Options:
    """Process-wide commlib options; unknown names raise ``AttributeError``.

    Values live in the instance ``__dict__`` so that reading an option (done on every
    collective) is a plain attribute lookup; every write goes through validation.
    """

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        for name, (parse, default, var, _) in _FIELDS.items():
            raw = env.get(var)
            if raw is None:
                self.__dict__[name] = default
                continue
            try:
                self.__dict__[name] = parse(raw)
            except ValueError as exc:
                raise ValueError(f"environment variable {var}={raw!r}: {exc}") from None
        known = {f[2] for f in _FIELDS.values()} | {"COMMLIB_TEST_MODE", *LAUNCH_VARIABLES}
        for var in env:
            if var.startswith("COMMLIB_") and var not in known and var not in RUNNER_VARIABLES:
                warnings.warn(f"unknown environment variable {var}; commlib reads "
                              f"{', '.join(sorted(known))}", stacklevel=2)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup failed: the name is not an option.
        raise AttributeError(self._unknown(name))

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _FIELDS:
            raise AttributeError(self._unknown(name))
        parse = _FIELDS[name][0]
        try:
            self.__dict__[name] = parse(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"commlib option {name!r}: {exc}") from None

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"commlib options cannot be deleted ({name!r})")

    def update(self, **values: Any) -> None:
        """Set several options; ``None`` values are skipped (keep the current setting)."""
        for name, value in values.items():
            if name not in _FIELDS:
                raise TypeError(self._unknown(name))
            if value is not None:
                setattr(self, name, value)

    def as_dict(self) -> dict[str, Any]:
        return {name: self.__dict__[name] for name in _FIELDS}

    @staticmethod
    def describe() -> dict[str, str]:
        """Each option's environment variable and meaning."""
        return {name: f"{f[2]}: {f[3]} (default {f[1]!r})" for name, f in _FIELDS.items()}

    @staticmethod
    def _unknown(name: str) -> str:
        return f"unknown commlib option {name!r}; known options: {', '.join(_FIELDS)}"

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items())
        return f"commlib.Options({inner})"


options = Options()
