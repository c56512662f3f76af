"""UCX settings that must be in place before MPI starts (UCX is the wheel's default netmod;
it reads its environment once, in ``MPI_Init``).

In fault-tolerant mode no message between two ranks of one machine may go through a UCX
transport that can see the peer die: MPICH's UCX netmod does not handle a request that
completes with an error, and the survivor dies with its peer. Two such transports exist on
one machine, both used only by UCX's rendezvous protocol (large messages):

* ``cma`` (cross-memory attach): the receiver copies straight out of the sender's memory
  (``process_vm_readv``); when the sender dies during the copy, the read fails ("No such
  process") and MPICH ends the receiver. Measured on the development machine (2 ranks, one
  hydra proxy each, ``-disable-auto-cleanup``, 16 MiB messages, the sender SIGKILLed while
  sending): the receiver died in 4 of 5 runs.
* ``tcp``: with ``cma`` left out (``UCX_TLS=^cma``), UCX takes ``tcp`` over the machine's
  own interface for the rendezvous lanes between two ranks of one machine
  (``UCX_LOG_LEVEL=info``: ``intra-node cfg#1 tag(sysv/memory tcp/eth0)``). A peer's death
  resets that connection, and MPICH then segfaults in the survivor's next collective
  (measured: 2 of 24 4-rank jobs under load, ``tests/test_elastic_ft.py``).

So fault-tolerant mode keeps every transport and turns off rendezvous between ranks of one
machine (``UCX_RNDV_THRESH=intra:inf,inter:auto``): every intra-node message goes as eager
fragments through shared-memory segments (``sysv``/``posix``), which stay mapped when a
peer dies and never report an error; messages between machines keep UCX's choice. Large
intra-node messages then take about twice as long (the probe above: 32-34 messages of
16 MiB a second against 68 with ``cma``).
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping

#: ``UCX_RNDV_THRESH`` for fault-tolerant mode when the user set none: no rendezvous
#: between ranks of one machine, UCX's own choice between machines.
FAULT_TOLERANT_RNDV_THRESH = "intra:inf,inter:auto"


def prepare_fault_tolerant(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``UCX_RNDV_THRESH`` to :data:`FAULT_TOLERANT_RNDV_THRESH` unless it is set;
    call before MPI starts. Returns whether it was set here."""
    env = os.environ if environ is None else environ
    if env.get("UCX_RNDV_THRESH") is not None:
        return False
    env["UCX_RNDV_THRESH"] = FAULT_TOLERANT_RNDV_THRESH
    return True


def in_use(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether the MPI library in use carries its messages over UCX (the MPICH wheel, unless
    ``MPIR_CVAR_CH4_NETMOD`` picks another netmod; not Open MPI's or Intel MPI's wheel:
    :attr:`commlib.mpi.mpi_impl.Implementation.uses_ucx`), so that these settings matter."""
    from .mpi_impl import current
    env = os.environ if environ is None else environ
    netmod = env.get("MPIR_CVAR_CH4_NETMOD", "ucx").strip().lower()
    return current().uses_ucx and netmod == "ucx"


def intra_node_rndv_off(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether ``UCX_RNDV_THRESH`` (UCX's syntax: a comma-separated list of a value and
    ``intra:``/``inter:`` pairs, the plain value being the default) turns rendezvous
    between ranks of one machine off (``inf``)."""
    env = os.environ if environ is None else environ
    default, intra = "auto", None
    for item in (env.get("UCX_RNDV_THRESH") or "").split(","):
        key, sep, value = item.strip().partition(":")
        if not sep:
            default = key.strip().lower() or default
        elif key.strip().lower() == "intra":
            intra = value.strip().lower()
    return (intra if intra is not None else default) == "inf"
