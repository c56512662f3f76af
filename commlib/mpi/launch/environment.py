"""Which job this process belongs to, read from its launcher's environment (no I/O).

A process forms a store-backed MPI world (see :mod:`commlib.mpi.launch`) when it is *not*
under an MPI launcher and its environment names a job of more than one process:

=============  ==========================================================================
launcher       variables read
=============  ==========================================================================
torchrun       ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``GROUP_RANK``
               (node), ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (checked against MPI's view),
               ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``,
               ``TORCHELASTIC_USE_AGENT_STORE``
env            the same without ``TORCHELASTIC_*`` (a Kubernetes PyTorchJob, or N processes
               started by hand): rank 0 hosts the store on ``MASTER_PORT``
slurm          inside an ``srun`` step (``SLURM_STEP_ID`` is set; a batch script's own
               shell is not a step): ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (else
               ``SLURM_NTASKS``), ``SLURM_NODEID``, ``SLURM_LOCALID``; the store is hosted
               by task 0 on ``MASTER_ADDR`` (default: the first host of
               ``SLURM_STEP_NODELIST``/``SLURM_JOB_NODELIST``, else
               ``SLURM_LAUNCH_NODE_IPADDR``) and ``MASTER_PORT`` (default:
               :func:`slurm_port`)
=============  ==========================================================================

torchrun's variables win when both are present (torchrun started by ``srun``, one agent
per node: ``RANK`` is set); an srun task without ``RANK`` is Slurm's even when the batch
script exported ``WORLD_SIZE`` (it must then equal the step's task count),
``MASTER_ADDR`` or ``MASTER_PORT`` (they are used). An MPI launcher is recognised by the PMI/PMIx/hydra/Open MPI variables it sets
(:data:`MPI_LAUNCHER_VARIABLES`); then nothing here applies and MPI forms its world as
always.

``COMMLIB_LAUNCH`` chooses: ``auto`` (default: the rules above), ``mpi`` (never form a
store-backed world: each process started without an MPI launcher is a world of 1),
``store`` (require a store-backed world: an error, naming what is missing, when the
environment does not name a job).
"""
from __future__ import annotations

import dataclasses
import os
import re
import socket
from collections.abc import Mapping

from ...base.options import LAUNCH_VARIABLES

#: Variables whose presence means an MPI launcher started this process (mpiexec/hydra,
#: a PMI-1 or PMI-2 server such as ``srun --mpi=pmi2``, PMIx, Open MPI's orted).
MPI_LAUNCHER_VARIABLES = ("PMI_FD", "PMI_PORT", "PMI_RANK", "PMI_SIZE", "PMI_ID",
                          "PMIX_RANK", "PMIX_NAMESPACE", "MPI_LOCALRANKID",
                          "HYDRA_CONTROL_FD", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
#: Set (to the process id) by a rank that formed a store-backed world; a process that
#: inherits it from its parent (a subprocess, a DataLoader worker started by spawn) is
#: that rank's child, not a rank, and does not try to join.
PARENT_VARIABLE = "COMMLIB_LAUNCH_PID"
MODES = ("auto", "mpi", "store")
#: The environment variables this layer reads that are its own (options knows them).
VARIABLES = LAUNCH_VARIABLES
#: Slurm ports: :func:`slurm_port` maps a job step into [SLURM_PORT_BASE, +SLURM_PORT_SPAN),
#: below Linux's default ephemeral range (32768-60999), so no outgoing connection holds it.
SLURM_PORT_BASE = 10000
SLURM_PORT_SPAN = 22000


@dataclasses.dataclass(frozen=True)
class Job:
    """One process's place in a job, as its launcher describes it."""

    launcher: str          # "torchrun", "env" or "slurm"
    rank: int
    size: int
    node: str              # ranks with the same node key share a host (shared memory)
    master_addr: str
    master_port: int
    use_agent_store: bool  # torchrun's agent hosts the store; else rank 0 does
    run_id: str
    attempt: int
    local_rank: int | None = None   # the launcher's, when it says
    local_size: int | None = None
    exported: tuple = ()   # (name, value) pairs to set for torch's env:// afterwards

    @property
    def namespace(self) -> str:
        """Prefix of every key commlib keeps in the store for this attempt (fresh per
        attempt: a namespace reused after a run with a killed rank hangs MPI_Init)."""
        return f"commlib/mpi/launch/{self.run_id}/{self.attempt}"

    def previous_namespaces(self) -> list[str]:
        return [f"commlib/mpi/launch/{self.run_id}/{a}" for a in range(self.attempt)]


class NoJob(Exception):
    """The environment names no job this layer can form a world for (the message says
    why, naming the variables)."""


def mode(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    value = env.get("COMMLIB_LAUNCH", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"environment variable COMMLIB_LAUNCH={env['COMMLIB_LAUNCH']!r}: "
                         f"expected one of {', '.join(MODES)}")
    return value


def mpi_launcher(environ: Mapping[str, str] | None = None) -> str | None:
    """The first MPI launcher variable set in ``environ``, or None."""
    env = os.environ if environ is None else environ
    return next((v for v in MPI_LAUNCHER_VARIABLES if v in env), None)


def detect(environ: Mapping[str, str] | None = None, pid: int | None = None) -> Job:
    """The job this process belongs to; raises :class:`NoJob` (saying why) when there is
    none to form a store-backed world for: an MPI launcher, a world of one, a child of a
    rank, ``COMMLIB_LAUNCH=mpi``, or missing variables."""
    env = os.environ if environ is None else environ
    chosen = mode(env)
    if chosen == "mpi":
        raise NoJob("COMMLIB_LAUNCH=mpi turns the store-backed world off")
    parent = env.get(PARENT_VARIABLE)
    if parent and parent != str(os.getpid() if pid is None else pid):
        raise NoJob(f"a child process of the rank with process id {parent} "
                    f"({PARENT_VARIABLE} is inherited), not a rank of the job")
    var = mpi_launcher(env)
    if var is not None:
        raise NoJob(f"started by an MPI launcher ({var} is set)")
    # A batch script often exports WORLD_SIZE (and MASTER_ADDR/MASTER_PORT) for the whole
    # job before `srun`: without a per-process RANK, an srun task is Slurm's.
    if "RANK" in env or ("WORLD_SIZE" in env and "SLURM_PROCID" not in env):
        return _torch_style(env)
    if "SLURM_PROCID" in env:
        return _slurm(env)
    raise NoJob("no launcher variables (torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT "
                "or an srun step's SLURM_PROCID/SLURM_NTASKS/SLURM_STEP_ID) are set")


def _int(env: Mapping[str, str], name: str, who: str) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        raise NoJob(f"{who}: {name} is not set")
    try:
        return int(raw)
    except ValueError:
        raise NoJob(f"{who}: {name}={raw!r} is not an integer") from None


def _optional_int(env: Mapping[str, str], name: str) -> int | None:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return None


def _check_rank(rank: int, size: int, who: str, names: str) -> None:
    if size < 1 or not 0 <= rank < size:
        raise NoJob(f"{who}: {names} = {rank}/{size} is not a rank of a world of that size")
    if size == 1:
        raise NoJob(f"{who}: a world of 1 process (MPI's singleton is that world)")


def _torch_style(env: Mapping[str, str]) -> Job:
    launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env"
    who = f"{launcher} environment"
    rank, size = _int(env, "RANK", who), _int(env, "WORLD_SIZE", who)
    _check_rank(rank, size, who, "RANK/WORLD_SIZE")
    addr = env.get("MASTER_ADDR", "")
    if not addr:
        raise NoJob(f"{who}: MASTER_ADDR is not set (the host of rank 0's store)")
    port = _int(env, "MASTER_PORT", who)
    group = env.get("GROUP_RANK", "")
    return Job(launcher=launcher, rank=rank, size=size,
               node=f"{socket.gethostname()}/{group}",
               master_addr=addr, master_port=port,
               use_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
               run_id=_safe(env.get("TORCHELASTIC_RUN_ID", "") or f"env-{port}"),
               attempt=_optional_int(env, "TORCHELASTIC_RESTART_COUNT") or 0,
               local_rank=_optional_int(env, "LOCAL_RANK"),
               local_size=_optional_int(env, "LOCAL_WORLD_SIZE"))


def _slurm(env: Mapping[str, str]) -> Job:
    who = "Slurm environment"
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", ""))
    if step == "":
        raise NoJob(f"{who}: SLURM_STEP_ID is not set (not a task of an srun step; a "
                    f"batch script's own shell is one process)")
    job_id = env.get("SLURM_JOB_ID", env.get("SLURM_JOBID", ""))
    if job_id == "":
        raise NoJob(f"{who}: SLURM_JOB_ID is not set")
    rank = _int(env, "SLURM_PROCID", who)
    size = (_optional_int(env, "SLURM_STEP_NUM_TASKS")
            or _int(env, "SLURM_NTASKS", who))
    _check_rank(rank, size, who, "SLURM_PROCID/SLURM_NTASKS")
    world_size = env.get("WORLD_SIZE", "")
    if world_size and world_size != str(size):
        raise NoJob(f"{who}: WORLD_SIZE={world_size!r} (set for the job) but the srun step "
                    f"has {size} tasks (SLURM_STEP_NUM_TASKS/SLURM_NTASKS)")
    addr = env.get("MASTER_ADDR", "")
    if not addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        hosts = expand_hostlist(nodelist) if nodelist else []
        addr = hosts[0] if hosts else env.get("SLURM_LAUNCH_NODE_IPADDR", "")
    if not addr:
        raise NoJob(f"{who}: none of MASTER_ADDR, SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, "
                    f"SLURM_LAUNCH_NODE_IPADDR is set (the host of task 0's store)")
    port = (_int(env, "MASTER_PORT", who) if env.get("MASTER_PORT")
            else slurm_port(job_id, step))
    exported = tuple((k, v) for k, v in (("MASTER_ADDR", addr), ("MASTER_PORT", str(port)))
                     if not env.get(k))
    return Job(launcher="slurm", rank=rank, size=size,
               node=f"{socket.gethostname()}/{env.get('SLURM_NODEID', '')}",
               master_addr=addr, master_port=port, use_agent_store=False,
               run_id=_safe(f"slurm-{job_id}.{step}"),
               attempt=_optional_int(env, "SLURM_RESTART_COUNT") or 0,
               local_rank=_optional_int(env, "SLURM_LOCALID"),
               local_size=_tasks_on_node(env), exported=exported)


def slurm_port(job_id: str, step_id: str) -> int:
    """The store port of a Slurm job step when ``MASTER_PORT`` is not set: the same on
    every task, different for consecutive steps of a job and for jobs whose ids are
    close: ``10000 + (job_id * 64 + step_id) mod 22000`` (ids that are not numbers are
    hashed)."""
    def number(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            return sum(ord(c) * 31 ** i for i, c in enumerate(text))
    return SLURM_PORT_BASE + (number(job_id) * 64 + number(step_id)) % SLURM_PORT_SPAN


def _tasks_on_node(env: Mapping[str, str]) -> int | None:
    """This node's task count from ``SLURM_STEP_TASKS_PER_NODE``/``SLURM_TASKS_PER_NODE``
    (e.g. ``2(x3),1``) and ``SLURM_NODEID``."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node = _optional_int(env, "SLURM_NODEID")
    if not spec or node is None:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if node < len(counts) else None


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list (``node[01-03,07],gpu-a[1-2]x,login``) as host names,
    in order."""
    hosts: list[str] = []
    for item in _split_top(text):
        parts = re.findall(r"\[[^\]]*\]|[^\[]+", item)
        expanded = [""]
        for part in parts:
            if part.startswith("["):
                choices = []
                for rng in part[1:-1].split(","):
                    lo, _, hi = rng.partition("-")
                    if hi:
                        width = len(lo)
                        choices += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
                    else:
                        choices.append(lo)
                expanded = [e + c for e in expanded for c in choices]
            else:
                expanded = [e + part for e in expanded]
        hosts += [h for h in expanded if h]
    return hosts


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [i.strip() for i in items if i.strip()]


def _safe(text: str) -> str:
    """A run id usable inside store keys and PMI values (no spaces or slashes)."""
    return re.sub(r"[^A-Za-z0-9_.:-]", "_", text)[:120] or "run"
