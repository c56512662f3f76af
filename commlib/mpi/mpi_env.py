"""The environment of torch.distributed's ``env://`` rendezvous, agreed over MPI.

Under an MPI launcher (``mpiexec -n N``, an MPI world of more than one process), importing
commlib fills in the variables that ``torch.distributed.init_process_group()`` and
torchrun-style scripts read, wherever they are missing:

==================  ===================================================================
``RANK``            the MPI world rank
``WORLD_SIZE``      the MPI world size
``LOCAL_RANK``      rank among the ranks of this node (shared-memory domain, or the
                    ``COMMLIB_LOCAL_SIZE`` block when nodes are simulated)
``LOCAL_WORLD_SIZE`` number of ranks on this node
``MASTER_ADDR``     rank 0's address: ``127.0.0.1`` when every rank is on rank 0's node,
                    else the address of rank 0's interface that routes to the other
                    nodes (never a fixed host name)
``MASTER_PORT``     a port rank 0 found free, sent to every rank through MPI
==================  ===================================================================

Variables the user (or another launcher) set are never overwritten; ``MASTER_ADDR`` and
``MASTER_PORT`` set on rank 0 only are taken by every rank. With these variables a script
that calls ``init_process_group()`` (gloo, commlib or no backend argument) runs unchanged
under ``mpiexec``.

Why at import: ``import commlib`` already initializes MPI (mpi4py), so every rank of an
MPI job is ready to agree, while torch reads the environment only later, in
``init_process_group``; scripts import commlib before that call, in whatever order they
import torch. The agreement is one ``Dup`` of ``COMM_WORLD`` (so it never matches the
program's own messages), a node split, a gather and a broadcast of a few bytes, then the
communicators are freed; in a singleton run (world of one process) nothing happens at
all. ``COMMLIB_TORCH_ENV=0`` turns it off.
"""
from __future__ import annotations

import os
import socket
import struct
import sys
import warnings
from collections.abc import Callable, MutableMapping, Sequence

from mpi4py import MPI

from ..base.options import options

VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT")
_published: dict[str, str] | None = None


def publish(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Collective over ``MPI.COMM_WORLD`` when it has more than one process (every rank
    calls it; commlib does at import): set the missing rendezvous variables (see the
    module docstring) in ``environ`` (default ``os.environ``). Returns the variables this
    rank set. A singleton run, a second call and ``COMMLIB_TORCH_ENV=0`` do nothing."""
    global _published
    env = os.environ if environ is None else environ
    world = MPI.COMM_WORLD
    if _published is not None or not options.torch_env or world.Get_size() == 1:
        return {}
    comm = world.Dup()
    try:
        rank, size = comm.Get_rank(), comm.Get_size()
        local_rank, local_size = _node(comm)
        single_node = local_size == size  # the same answer on every rank
        hosts = comm.gather(None if single_node else _describe_host(), root=0)
        master: tuple[str, str] | str | None = None
        if rank == 0:
            try:  # whatever happens, every rank gets an answer: nobody waits forever
                addr = env.get("MASTER_ADDR") or (
                    "127.0.0.1" if single_node else choose_master_addr(hosts, route_source))
                master = (addr, env.get("MASTER_PORT") or str(free_port()))
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                master = repr(exc)
        master = comm.bcast(master, root=0)
    finally:
        comm.Free()
    if isinstance(master, str):
        warnings.warn(f"commlib: rank 0 could not choose MASTER_ADDR/MASTER_PORT ({master}); "
                      f"torch.distributed's env:// variables were not set", stacklevel=2)
        return {}
    addr, port = master
    values = {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local_rank),
              "LOCAL_WORLD_SIZE": str(local_size), "MASTER_ADDR": addr, "MASTER_PORT": port}
    _published = {k: v for k, v in values.items() if k not in env}
    env.update(_published)
    return dict(_published)


#: (rank variable, size variable) that MPI launchers set in each process's environment:
#: MPICH's hydra and other PMI-1/PMI-2 launchers (Intel MPI's, ``srun --mpi=pmi2``),
#: Open MPI's, MVAPICH's.
LAUNCHER_VARIABLES = (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                      ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"))


def launcher_world(environ: MutableMapping[str, str] | None = None) -> tuple[int, int] | None:
    """``(rank, size)`` of this process in the job of the MPI launcher that started it, read
    from the environment alone (no MPI call), or None when no launcher variables are set
    (a plain ``python`` process, a singleton)."""
    env = os.environ if environ is None else environ
    for rank_var, size_var in LAUNCHER_VARIABLES:
        try:
            rank, size = int(env[rank_var]), int(env[size_var])
        except (KeyError, ValueError):
            continue
        if size >= 1 and 0 <= rank < size:
            return rank, size
    return None


def _node(comm: MPI.Comm) -> tuple[int, int]:
    """(rank on this node, ranks on this node), as commlib's hierarchical collectives see
    nodes: shared-memory domains, or blocks of ``COMMLIB_LOCAL_SIZE`` consecutive ranks."""
    rank, size, k = comm.Get_rank(), comm.Get_size(), options.local_size
    if k is not None:
        return rank % k, min(k, size - (rank // k) * k)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        return local.Get_rank(), local.Get_size()
    finally:
        local.Free()


def _describe_host() -> tuple[str, list[str]]:
    try:
        return socket.gethostname(), host_addresses()
    except OSError:
        return "", []


def choose_master_addr(hosts: Sequence[tuple[str, list[str]]],
                       route: Callable[[str], str | None]) -> str:
    """Rank 0's address for ranks on other nodes. ``hosts[r]`` is rank ``r``'s
    ``(hostname, IPv4 addresses)``; ``route(ip)`` is rank 0's source address towards
    ``ip``. Peers on another host are tried first (ranks sharing rank 0's host name only
    when there are none, as with simulated nodes); the first non-loopback source address
    wins; then rank 0's own first non-loopback address; then its fully qualified name."""
    name0, own = hosts[0]
    peers = [addrs for host, addrs in hosts[1:] if host != name0] or \
        [addrs for _, addrs in hosts[1:]]
    for addrs in peers:
        for ip in addrs:
            source = route(ip)
            if source and not _loopback(source):
                return source
    for ip in own:
        if not _loopback(ip):
            return ip
    return socket.getfqdn()


def route_source(ip: str) -> str | None:
    """The local address the kernel would send from to reach ``ip`` (a UDP ``connect``
    only looks the route up; no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def host_addresses() -> list[str]:
    """This host's non-loopback IPv4 addresses: its interfaces' (Linux), else what its
    host name resolves to."""
    found: list[str] = []
    if sys.platform.startswith("linux"):
        import fcntl
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                         struct.pack("256s", name[:15].encode()))
                except OSError:
                    continue
                found.append(socket.inet_ntoa(packed[20:24]))
    if not found:
        try:
            found = [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None,
                                                               socket.AF_INET)]
        except OSError:
            pass
    return list(dict.fromkeys(ip for ip in found if not _loopback(ip)))


def free_port() -> int:
    """A TCP port no socket on this host is bound to right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip == "::1"
