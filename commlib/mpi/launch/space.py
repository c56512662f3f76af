"""A job's PMI key-value space and barrier, kept in a torch.distributed store.

Every key lives under the attempt's namespace (``commlib/mpi/launch/<run id>/<attempt>/``),
apart from torch's own keys (``init/``, ``default_pg/...``, ``/worker/attempt_N/...``):

=========================  ===================================================================
``nonce``                  the attempt's random id, the first writer's (``compare_set``);
                           the MPI namespace name is ``commlib_<nonce>``, so MPICH's
                           shared-memory segment names are new for every job
``node/<rank>``            the rank's node key (host name and launcher node id)
``kv/<key>``               a PMI ``put``
``barrier/<n>``            arrivals at the n-th PMI barrier (``add``); ``.../in`` who came
                           (``append``); ``.../out`` set by the last to arrive
``abort``                  ``"<rank> <exit code>"`` once a rank called ``MPI_Abort``
``left/<rank>``             set once the rank is done with the store, or by a survivor for
                           a dead rank (the store's hosts wait for every rank's before
                           they exit)
``standby/<n>``            the n-th standby store (``"<rank> <address> <port>"``, fault-
                           tolerant mode: :mod:`commlib.mpi.launch.standby`)
=========================  ===================================================================

Values are strings; nothing read from the store is unpickled or evaluated. Every key
written after ``MPI_Init`` is one rank's own (or a survivor's record of a dead rank), set
to its latest value, so a standby store that a rank joins late can be given it again
(:mod:`commlib.mpi.launch.standby`).
"""
from __future__ import annotations

import datetime
import os
import secrets
import threading
from collections.abc import Iterable
from typing import Any


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) \
        else str(value)


def format_ranks(ranks: Iterable[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3,7"`` (the format of MPICH's ``PMI_dead_processes``)."""
    out: list[str] = []
    run: list[int] = []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [r]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def process_mapping(nodes: list[str]) -> tuple[str, list[int]]:
    """(``PMI_process_mapping``, node id of each rank) for ranks whose node keys are
    ``nodes``: node ids numbered by first appearance; the mapping is MPICH's
    ``(vector,(first node,node count,ranks per node),...)``, consecutive ranks of one
    node one block, consecutive equal-sized blocks of consecutive nodes merged."""
    ids: dict[str, int] = {}
    node_of = [ids.setdefault(n, len(ids)) for n in nodes]
    runs: list[list[int]] = []  # [node, length]
    for node in node_of:
        if runs and runs[-1][0] == node:
            runs[-1][1] += 1
        else:
            runs.append([node, 1])
    blocks: list[list[int]] = []  # [first node, node count, ranks per node]
    for node, length in runs:
        last = blocks[-1] if blocks else None
        if last and last[2] == length and last[0] + last[1] == node:
            last[1] += 1
        else:
            blocks.append([node, 1, length])
    text = "(vector," + ",".join(f"({a},{b},{c})" for a, b, c in blocks) + ")"
    return text, node_of


class StoreSpace:
    """The PMI state of one rank of a job, in ``store`` under ``namespace``."""

    def __init__(self, store: Any, namespace: str, rank: int, size: int, node: str,
                 timeout: float) -> None:
        self.store, self.ns, self.rank, self.size = store, namespace, rank, size
        self.timeout = timeout
        self._barriers = 0
        self._mapping: tuple[str, list[int]] | None = None
        self._lock = threading.Lock()  # the store client is shared with the monitor
        #: Ranks known to be dead, answered to ``PMI_dead_processes`` (what
        #: ``MPIX_Comm_get_failed`` reads): a failure detector (issue 21) adds to it.
        self.dead: set[int] = set()
        nonce = self._call("compare_set", self.key("nonce"), "", secrets.token_hex(8))
        self.kvsname = f"commlib_{_text(nonce)}"
        self._call("set", self.key(f"node/{rank}"), node)

    def key(self, name: str) -> str:
        return f"{self.ns}/{name}"

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            return getattr(self.store, method)(*args)

    def _wait(self, keys: list[str], timeout: float | None = None) -> None:
        self._call("wait", keys, datetime.timedelta(seconds=timeout or self.timeout))

    # -- PMI -------------------------------------------------------------------------
    def put(self, key: str, value: str) -> None:
        self._call("set", self.key(f"kv/{key}"), value)

    def get(self, key: str) -> str | None:
        k = self.key(f"kv/{key}")
        if not self._call("check", [k]):
            return None
        return _text(self._call("get", k))

    def barrier(self) -> None:
        """Return once every rank entered this (n-th) barrier; :class:`TimeoutError`
        naming the ranks that did not, after ``timeout`` seconds."""
        self._barriers += 1
        key = self.key(f"barrier/{self._barriers}")
        self._call("append", f"{key}/in", f"{self.rank},")
        if self._call("add", key, 1) == self.size:
            self._call("set", f"{key}/out", "1")
        try:
            self._wait([f"{key}/out"])
        except RuntimeError:  # torch's DistStoreError: the wait timed out
            came = {int(r) for r in _text(self._call("get", f"{key}/in")).split(",") if r}
            missing = sorted(set(range(self.size)) - came)
            raise TimeoutError(
                f"PMI barrier {self._barriers} (in MPI_Init or MPI_Finalize): ranks "
                f"{format_ranks(missing)} of {self.size} did not arrive within "
                f"{self.timeout:g} s (COMMLIB_TIMEOUT)") from None

    def nodes(self) -> list[str]:
        """Every rank's node key (waits until every rank has started)."""
        keys = [self.key(f"node/{r}") for r in range(self.size)]
        try:
            self._wait(keys)
        except RuntimeError:
            missing = [r for r, k in enumerate(keys) if not self._call("check", [k])]
            raise TimeoutError(
                f"ranks {format_ranks(missing)} of {self.size} did not join within "
                f"{self.timeout:g} s (COMMLIB_TIMEOUT): not started, or started with "
                f"another MASTER_ADDR/MASTER_PORT, run id or restart count") from None
        return [_text(v) for v in self._call("multi_get", keys)]

    def mapping(self) -> tuple[str, list[int]]:
        if self._mapping is None:
            self._mapping = process_mapping(self.nodes())
        return self._mapping

    def process_mapping(self) -> str:
        return self.mapping()[0]

    def dead_processes(self) -> str:
        return format_ranks(self.dead)

    def abort(self, code: int, message: str) -> None:
        """This rank called ``MPI_Abort``: tell the others (their monitors leave with
        ``code``), then end this process at once, as an MPI launcher would (MPICH 5.0's
        ``MPI_Abort`` returns and leaves the ending to the process manager)."""
        self.record_abort(code)
        os._exit(code)

    def record_abort(self, code: int) -> None:
        """Set ``abort`` (the first rank to abort wins); never raises."""
        try:
            self._call("compare_set", self.key("abort"), "", f"{self.rank} {code}")
        except Exception:  # noqa: BLE001 - the store may be gone; the process exits anyway
            pass

    # -- job state -------------------------------------------------------------------
    def aborted(self) -> tuple[int, int] | None:
        """(rank, exit code) of the first rank that called MPI_Abort, or None."""
        k = self.key("abort")
        if not self._call("check", [k]):
            return None
        rank, _, code = _text(self._call("get", k)).partition(" ")
        return int(rank), int(code)

    def leave(self) -> None:
        """Say this rank is done with the store."""
        self.leave_for([self.rank])

    def leave_for(self, ranks: Iterable[int]) -> None:
        """Count ``ranks`` as done with the store (this rank, or dead ranks, which never
        leave: a survivor counts them; idempotent)."""
        for r in sorted(set(ranks)):
            self._call("set", self.key(f"left/{r}"), "1")

    def wait_all_left(self, timeout: float) -> bool:
        try:
            self._wait([self.key(f"left/{r}") for r in range(self.size)], timeout)
            return True
        except RuntimeError:
            return False

    def shared_keys(self) -> list[str]:
        """Keys (relative to the namespace) that a new standby store copies from the
        primary: the records of ranks that may not be alive to write them again."""
        return ["abort"] + [f"left/{r}" for r in range(self.size)]

    def refresh(self) -> None:
        """The launch monitor's poll: keep a standby store in place (a no-op without)."""
        refresh = getattr(self.store, "refresh", None)
        if refresh is not None:
            with self._lock:
                refresh()

    def store_lost(self, host: int) -> None:
        """The store's host ``host`` died and a standby took over: it is dead, and
        counts as left."""
        self.dead.add(host)
        self.store.set(self.key(f"left/{host}"), "1")

    def previous_kvsname(self, namespace: str) -> str | None:
        k = f"{namespace}/nonce"
        if not self._call("check", [k]):
            return None
        return f"commlib_{_text(self._call('get', k))}"
