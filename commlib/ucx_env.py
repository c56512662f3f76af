"""UCX settings that must be in place before MPI starts (UCX is the wheel's default netmod;
it reads its environment once, in ``MPI_Init``).

Fault-tolerant mode leaves out UCX's cross-memory-attach transport (``cma``) unless the
user chose ``UCX_TLS``. With ``cma``, a large message between two ranks of one machine is
copied by the receiver straight out of the sender's memory (``process_vm_readv``). When the
sender dies during that copy, the read fails ("No such process") and MPICH ends the
*receiving* rank with it: a survivor dies of its peer's death. On the development machine
(2 ranks, one hydra proxy each, ``-disable-auto-cleanup``, 16 MiB messages, the sender
SIGKILLed while sending) the receiver died in 4 of 5 runs with ``cma`` and lived in 5 of 5
without it. Without ``cma`` such messages go through shared-memory segments, which stay
mapped when the sender dies; large intra-node messages then take about twice as long
(the same probe: 23-34 messages in 1 s against 68).
"""
from __future__ import annotations

import os
from typing import MutableMapping

#: ``UCX_TLS`` for fault-tolerant mode when the user set none: every transport but ``cma``.
FAULT_TOLERANT_UCX_TLS = "^cma"


def prepare_fault_tolerant(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``UCX_TLS`` to :data:`FAULT_TOLERANT_UCX_TLS` unless it is set; call before MPI
    starts. Returns whether it was set here."""
    env = os.environ if environ is None else environ
    if env.get("UCX_TLS") is not None:
        return False
    env["UCX_TLS"] = FAULT_TOLERANT_UCX_TLS
    return True


def cma_excluded(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether ``UCX_TLS`` (UCX's syntax: a list of transports, or ``^`` and the list of
    those left out) leaves ``cma`` out."""
    env = os.environ if environ is None else environ
    tls = (env.get("UCX_TLS") or "").strip()
    if not tls:
        return False
    if tls.startswith("^"):
        return "cma" in {t.strip() for t in tls[1:].split(",")}
    names = {t.strip() for t in tls.split(",")}
    return not names & {"cma", "all", "sm", "shm"}
