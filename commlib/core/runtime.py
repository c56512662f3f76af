"""Process-wide state: the world communicator and the watchdog (the exit paths, the
abort-on-exception hook included, are in :mod:`commlib.core.exits`)."""
from __future__ import annotations

import os
import sys
import warnings
import zlib
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from ..base.errors import CommError
from ..base.options import options
from ..fault import failure_detection
from ..mpi import ucx_env
from ..mpi.watchdog import Watchdog, abort_job
from . import communicator, exits
from .communicator import Communicator, describe_pending

_world: Communicator | None = None
_world_source: Any = None  # the communicator init() was given (commlib works on a Dup)
_watchdog: Watchdog | None = None


def _on_expiry(pending: tuple[Any, ...]) -> None:
    what = describe_pending(pending)
    abort_job(f"[commlib] rank {MPI.COMM_WORLD.Get_rank()}: {what} did not complete within "
              f"{options.timeout:g} s (COMMLIB_TIMEOUT); a peer is missing, has failed or "
              f"called a different collective. Aborting the job.")


def init(comm: Any = None, check: bool | None = None, **opts: Any) -> Communicator:
    """Initialize commlib (idempotent) and return the world communicator.

    ``comm`` is the :class:`mpi4py.MPI.Comm` that commlib treats as its world (default
    :data:`mpi4py.MPI.COMM_WORLD`; it is duplicated so commlib's messages never match the caller's).
    ``check`` turns checking mode on or off; other keyword arguments set
    :data:`commlib.options` (``timeout``, ``local_size``, ``cuda_aware``,
    ``abort_on_exception``...), and unknown names raise ``TypeError``. A second call with a
    different ``comm`` raises :class:`CommError`; options given on later calls still apply.

    A world of one MPI process while ``WORLD_SIZE`` > 1 is set (``torchrun`` or another
    launcher without MPI), or in an ``srun`` step of several tasks, raises :class:`CommError` naming the launcher and the fix
    (``mpiexec -n N python script.py``), since every process would otherwise run alone.
    """
    global _world, _world_source, _watchdog
    options.update(check=check, **opts)
    if _world is not None:
        if comm is not None and comm is not _world_source:
            raise CommError("commlib.init: already initialized with another communicator")
        return _world
    if options.fault_tolerant:
        _warn_if_intra_rndv()
    if comm is None:
        check_launcher(os.environ)
    source = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(source, MPI.Comm):
        raise TypeError(f"commlib.init: argument 'comm' must be an mpi4py.MPI.Comm, "
                        f"got {type(source).__name__}")
    _watchdog = Watchdog(_on_expiry)
    # one exchange: the world ranks, what decides how blocking calls wait (every rank
    # decides the same from the same list), and what lets fault-tolerant mode watch the
    # processes of this machine
    mine = (MPI.COMM_WORLD.Get_rank(), _machine(), _cores(), failure_detection.this_process())
    everyone = source.allgather(mine)
    world_ranks = tuple(r for r, *_ in everyone)
    communicator.WAIT_POLL_S = wait_poll_s([e[:3] for e in everyone], options.wait_poll_us)
    communicator.WORLD_KEY = zlib.crc32(repr(everyone[0][3]).encode()) & 0x7FFFFFFF
    failure_detection.watch_local({r: proc for r, _, _, proc in everyone})
    _world = Communicator(source.Dup(), _watchdog, "world", world_ranks)
    _world_source = source
    if MPI.COMM_WORLD.Get_size() > 1:  # done at import under a known MPI launcher
        exits.arm(collective=comm is None)
    for hook in _init_hooks:
        hook()
    return _world


def _machine() -> str:
    """What names this process's machine for sharing cores: the running kernel's boot id
    (the same in every network, UTS or container namespace of one machine, so emulated
    nodes on one host count as one), else MPI's processor name."""
    boot = failure_detection.boot_id()
    return "boot:" + boot if boot else MPI.Get_processor_name()


def _warn_if_intra_rndv() -> None:
    """Fault-tolerant mode turned on after MPI started with UCX's rendezvous between ranks
    of one machine (see :mod:`commlib.mpi.ucx_env`): say what a death can then do, and how to
    avoid it."""
    if MPI.COMM_WORLD.Get_size() > 1 and ucx_env.in_use() and not ucx_env.intra_node_rndv_off():
        warnings.warn(
            "commlib: fault-tolerant mode with UCX's rendezvous between ranks of one machine "
            "(cma or tcp): a rank that dies while exchanging a large message with a rank of "
            "its own machine can end that rank too. Set COMMLIB_FAULT_TOLERANT=1 in the "
            "launch environment (commlib then starts UCX with "
            f"UCX_RNDV_THRESH={ucx_env.FAULT_TOLERANT_RNDV_THRESH}) or set that variable",
            RuntimeWarning, stacklevel=3)


def _cores() -> tuple[int, ...]:
    """The CPUs this process may run on (its affinity; the machine's CPUs elsewhere)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


#: The poll interval of ``wait_poll_us="auto"`` on an oversubscribed host.
AUTO_POLL_S = 50e-6


def wait_poll_s(everyone: list[tuple[Any, str, Any]], setting: Any) -> float:
    """Seconds between tests of a blocking call's wait for the whole job (0: block in
    MPI), from every rank's ``(world rank, machine, cores)`` and the ``wait_poll_us``
    option: a number is taken as given; ``"auto"`` polls every :data:`AUTO_POLL_S` when
    some host runs more of the job's ranks than its ranks can run on (measured on 2
    cores: FSDP's step at 4 ranks halves, docs/benchmarks/sharded.md), else 0. ``cores`` is the
    CPUs a rank may run on (its affinity, :func:`_cores`; a count ``n`` means CPUs
    ``0..n-1``): a host's CPUs are the union of its ranks', so ranks that the launcher
    bound to one core each (Open MPI, Intel MPI) are not oversubscribed."""
    if setting != "auto":
        return float(setting) * 1e-6
    ranks: dict[str, int] = {}
    cores: dict[str, set[int]] = {}
    for _, host, cpus in everyone:
        ranks[host] = ranks.get(host, 0) + 1
        cores.setdefault(host, set()).update(range(cpus) if isinstance(cpus, int) else cpus)
    return AUTO_POLL_S if any(ranks[h] > len(cores[h]) for h in ranks) else 0.0


# Called at the end of every init() that makes the world, in registration order; layers
# above this one register here (the timeline starts itself when COMMLIB_TIMELINE is set),
# so that this module never imports upward.
_init_hooks: list[Callable[[], Any]] = []


def on_init(hook: Callable[[], Any]) -> None:
    """Run ``hook()`` at the end of each :func:`init` that creates the world."""
    _init_hooks.append(hook)


def check_launcher(environ: Any) -> None:
    """Raise :class:`CommError` when ``environ`` says the job has ``WORLD_SIZE`` > 1
    processes, or this process is a task of an ``srun`` step of more than one task
    (``SLURM_STEP_ID``, ``SLURM_STEP_NUM_TASKS``), but MPI sees a world of one: the
    processes were started by ``torchrun`` (which sets ``TORCHELASTIC_RUN_ID`` and
    ``GROUP_RANK``), ``srun`` or another launcher, not by ``mpiexec``, and commlib could
    not form the job's world from the launcher's store (:mod:`commlib.mpi.launch` says why:
    ``COMMLIB_LAUNCH=mpi``, ``mpi4py.MPI`` imported first, a missing variable, an
    ``srun --mpi=pmix`` step...), so each process would run alone. Under ``srun``,
    ``COMMLIB_LAUNCH=mpi`` says the tasks are meant to run alone (a sweep): no error."""
    try:
        n = int(environ.get("WORLD_SIZE", ""))
    except ValueError:
        n = 0
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID", ""))
    # An srun task without a per-process RANK (a WORLD_SIZE the batch script exported
    # for the job does not make it torchrun's), as commlib.mpi.launch reads it.
    slurm = step != "" and "RANK" not in environ
    if slurm:
        try:
            n = int(environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS", ""))
        except ValueError:
            return
        if environ.get("COMMLIB_LAUNCH", "").strip().lower() == "mpi":
            return
    if n <= 1 or MPI.COMM_WORLD.Get_size() != 1:
        return
    from ..mpi import launch
    why = launch.why_not() or "it was not attempted"
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "script.py"
    if slurm:
        from ..mpi.mpi_impl import current
        impl = current()
        job = environ.get("SLURM_JOB_ID", environ.get("SLURM_JOBID", "?"))
        if impl.store_world:
            fix = (f"under `srun --mpi=pmix` (or a cluster whose MpiDefault is pmix) "
                   f"{impl.describe()}, which speaks PMI-1 only, cannot use Slurm's PMIx "
                   f"server: run `srun --mpi=none python {script}` (commlib forms the world "
                   f"from a store on the step's first node) or `srun --mpi=pmi2 python "
                   f"{script}` (Slurm's PMI server)")
        else:
            plugins = " or ".join(f"`srun --mpi={p} python {script}`"
                                  for p in impl.slurm_mpi_plugins) or "mpirun"
            fix = (f"{impl.describe()} forms its world only from a PMIx server "
                   f"({impl.store_world_refusal.split(';')[0]}): run {plugins} (Slurm built "
                   f"with PMIx; `srun --mpi=list` shows the plugins), or `mpirun -n {n} "
                   f"python {script}` inside the allocation")
        raise CommError(
            f"commlib.init (task {environ.get('SLURM_PROCID', '?')} of {n} of Slurm step "
            f"{job}.{step}): this process was started by srun, but MPI sees a world of 1 "
            f"process, so each task would run alone: commlib did not form the step's MPI "
            f"world because {why}. Fix that: import commlib before mpi4py.MPI; {fix}. If "
            f"every task is meant to run alone, set COMMLIB_LAUNCH=mpi.")
    if "TORCHELASTIC_RUN_ID" in environ or "GROUP_RANK" in environ:
        launcher = "torchrun (TORCHELASTIC_RUN_ID/GROUP_RANK are set)"
    else:
        launcher = "a launcher that is not an MPI launcher"
    raise CommError(
        f"commlib.init (rank {environ.get('RANK', '?')} of WORLD_SIZE={n}): this process was "
        f"started by {launcher}, but MPI sees a world of 1 process, so each process would "
        f"run alone: commlib did not form the job's MPI world from the launcher's "
        f"environment because {why}. Fix that (with COMMLIB_LAUNCH=auto, the default, "
        f"importing commlib before mpi4py.MPI forms the world from torchrun's, Kubernetes' "
        f"or srun's variables), or launch the job with `mpiexec -n {n} python {script}`.")


def is_initialized() -> bool:
    return _world is not None


def world() -> Communicator:
    """The world communicator, initializing commlib on first use."""
    return _world if _world is not None else init()


def thread_multiple() -> bool:
    """Whether MPI was initialized with ``MPI_THREAD_MULTIPLE`` (needed to communicate from a
    background thread while the main thread may also call MPI)."""
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


def get_rank() -> int:
    """This process's rank in the world communicator."""
    return world().rank


def get_world_size() -> int:
    """Number of ranks in the world communicator."""
    return world().size


def get_local_rank() -> int:
    """Rank within this node (shared-memory domain, or ``COMMLIB_LOCAL_SIZE`` block)."""
    return world().node()[0].rank


def get_local_size() -> int:
    """Number of ranks on this node (see :func:`get_local_rank`)."""
    return world().node()[0].size
