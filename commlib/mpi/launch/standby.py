"""No single point of failure in a store-backed world: a standby store that takes over
when the store's host dies.

The job's torch ``TCPStore`` lives in one process (rank 0's, see
:mod:`commlib.mpi.launch.world`). In fault-tolerant mode (``COMMLIB_FAULT_TOLERANT=1`` in
the environment) that store is a :class:`ReplicatedStore`:

* after ``MPI_Init`` the lowest rank that is neither dead nor the store's host (rank 1 at
  first) hosts a second ``TCPStore`` on a free port and announces it in the store
  (``standby/<n>``: ``"<rank> <address> <port>"``; the address is the one this rank
  reaches the store's host from); every rank connects to it (the launch monitor looks
  every :data:`commlib.mpi.launch.world.POLL_S` s) and replays there its own writes
  so far (the latest value of each key it set, added to or compare-set);
* from then on every write (``set``, ``add``, ``compare_set``, ``append``) goes to both
  stores, every read (``get``, ``check``, ``wait``, ``multi_get``, ``add(key, 0)``) to the
  primary only: heartbeats, process ids, exits and aborts are in both;
* when the primary is lost (an operation fails with torch's ``DistNetworkError``: its
  host's process is gone and the connection closed), each rank on its own switches to the
  standby (the same for every rank: the one announced), adds the old host to the ranks it
  answers to ``PMI_dead_processes`` and tells :class:`ReplicatedStore`'s ``on_failover``
  callback; the next standby is then hosted by the lowest rank alive other than the new
  host (the first to announce ``standby/<n+1>`` with ``compare_set`` wins), which first
  copies into it the keys of ranks that cannot replay theirs any more
  (:attr:`ReplicatedStore.shared_keys`: exits, the abort);
* a standby that is lost (its host died) is dropped the same way, and the next one is
  hosted by the next rank.

So successive single deaths are survived, the store's host's included, as long as a
standby was in place (every rank connected) before each: **not survived** are a death
during ``MPI_Init`` (no standby yet), the deaths of the store's host and of its standby's
host within one monitor period, and a death of the host while the next standby is being
announced (its rank would then have no store to switch to: it leaves with exit code 1, as
before). A host whose machine vanishes without closing its connections (power loss, a
network partition) is noticed only when an operation times out (``COMMLIB_TIMEOUT``).

``COMMLIB_STORE_STANDBY=0`` turns the standby off (the store's host is then a single point
of failure again: its death ends every rank with exit code 1); torchrun's agent's store
(``TORCHELASTIC_USE_AGENT_STORE``) never has one: it lives outside the ranks.
"""
from __future__ import annotations

import datetime
import socket
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

#: Seconds to connect to an announced standby (a dead host is then passed over).
CONNECT_S = 2.0
VARIABLE = "COMMLIB_STORE_STANDBY"


def wanted(environ: Any) -> bool:
    """Whether a store-backed world gets a standby store: in fault-tolerant mode
    (``COMMLIB_FAULT_TOLERANT`` true in the environment, read before MPI starts), unless
    ``COMMLIB_STORE_STANDBY`` is ``0`` (or ``false``, ``no``, ``off``)."""
    def true(name: str, default: str) -> bool:
        return str(environ.get(name, default)).strip().lower() in ("1", "true", "yes", "on")
    return true("COMMLIB_FAULT_TOLERANT", "0") and true(VARIABLE, "1")


def lost(exc: BaseException) -> bool:
    """Whether a store operation failed because the store is gone (its host's process
    ended: the connection was closed), not because a wait timed out."""
    return any(c.__name__ == "DistNetworkError" for c in type(exc).__mro__)


def local_address(peer: str, port: int) -> str:
    """This host's address on the route to ``peer`` (where the others can reach a store
    this rank hosts, assuming it is reached as the store's host is)."""
    try:
        family = socket.getaddrinfo(peer, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family[0], socket.SOCK_DGRAM) as s:
            s.connect(family[4])
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) \
        else str(value)


class ReplicatedStore:
    """The store client of one rank, with a standby (see the module docstring); the
    subset of torch's ``Store`` that :class:`~commlib.mpi.launch.space.StoreSpace` and the
    layers above use. Not thread-safe: callers serialize (``StoreSpace._call``).

    ``dead()``: the ranks known dead (the standby's host is chosen among the others);
    ``on_failover(old_host)``: called after each switch to the standby."""

    def __init__(self, primary: Any, host: int, rank: int, size: int, namespace: str,
                 address: tuple[str, int], timeout: float,
                 dead: Callable[[], Iterable[int]],
                 on_failover: Callable[[int], None] | None = None) -> None:
        self.primary, self.host, self.address = primary, host, address
        self.rank, self.size, self.ns, self.timeout = rank, size, namespace, timeout
        self.dead, self.on_failover = dead, on_failover
        self.standby: Any = None
        self.standby_host: int | None = None
        self.standby_address: tuple[str, int] | None = None
        #: the standby attached, or the one expected next: key ``standby/<slot>``
        self.slot = 0
        #: this rank's writes: key -> (method, args) replaying the latest value
        self.log: dict[str, tuple[str, tuple]] = {}
        #: keys copied from the primary into a new standby by its host (other ranks'
        #: records that they may not be alive to replay): name relative to the namespace
        self.shared_keys: Callable[[], list[str]] = lambda: []
        self.servers: list[Any] = []   # stores this rank hosts (alive until it exits)
        self.failovers: list[tuple[float, int, int]] = []  # (time, old host, new host)
        self._failed_slot = -1     # the slot this rank could not host a standby for
        self._primary_error: BaseException | None = None
        #: this rank has told the store it is done (``left/<rank>``); a primary lost
        #: after that is, most often, its host leaving because every rank has left
        #: (another store host of this rank is still waiting for the others)
        self.left = False

    # -- reads: the primary ------------------------------------------------------------
    def get(self, key: str) -> Any:
        return self._primary("get", key)

    def check(self, keys: list[str]) -> bool:
        return self._primary("check", keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        return self._primary("wait", keys) if timeout is None else \
            self._primary("wait", keys, timeout)

    def multi_get(self, keys: list[str]) -> Any:
        return self._primary("multi_get", keys)

    # -- writes: both ------------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        self._primary("set", key, value)
        self.log[key] = ("set", (key, value))
        self._mirror("set", key, value)

    def add(self, key: str, amount: int) -> int:
        value = self._primary("add", key, amount)
        if amount:
            self.log[key] = ("set", (key, str(value)))
            self._mirror("add", key, amount)
        return value

    def compare_set(self, key: str, expected: Any, desired: Any) -> Any:
        value = self._primary("compare_set", key, expected, desired)
        self.log[key] = ("compare_set", (key, expected, _text(value)))
        self._mirror("compare_set", key, expected, _text(value))
        return value

    def append(self, key: str, value: Any) -> None:
        # (PMI barriers, before the standby exists: not replayed)
        self._primary("append", key, value)
        self._mirror("append", key, value)

    # -- failover ----------------------------------------------------------------------
    def _primary(self, method: str, *args: Any) -> Any:
        while True:
            try:
                return getattr(self.primary, method)(*args)
            except Exception as exc:
                if not lost(exc) or not self.fail_over():
                    self._primary_error = exc
                    raise

    def _primary_lost_in(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the primary's loss (not the standby's own trouble)."""
        return exc is self._primary_error

    def _mirror(self, method: str, *args: Any) -> None:
        if self.standby is None:
            return
        try:
            getattr(self.standby, method)(*args)
        except Exception as exc:  # noqa: BLE001 - the standby's host died: drop it
            if not lost(exc):
                raise
            self._drop_standby()

    def _drop_standby(self) -> None:
        _note(self.rank, f"lost the standby store of rank {self.standby_host}; the next "
                         f"one will be hosted by the lowest rank alive")
        self.standby = self.standby_host = self.standby_address = None
        self.slot += 1

    def fail_over(self) -> bool:
        """The primary is lost: switch to the standby (False when there is none)."""
        if self.standby is None:
            return False
        old, new = self.host, self.standby_host
        assert new is not None and self.standby_address is not None
        self.primary, self.host, self.address = self.standby, new, self.standby_address
        self.standby = self.standby_host = self.standby_address = None
        self.slot += 1
        self.failovers.append((time.monotonic(), old, new))
        if self.left:
            _note(self.rank, f"the store of rank {old} closed after this rank left (its "
                             f"host left or died): rank {new}'s standby store serves the "
                             f"ranks still leaving")
        else:
            _note(self.rank, f"lost the store of rank {old} (its host died): rank {new}'s "
                             f"standby store is the store now")
        if self.on_failover is not None:
            self.on_failover(old)
        return True

    def refresh(self) -> None:
        """Connect to the announced standby, or host it when this rank is the one to, or
        notice that the standby was lost (the launch monitor calls it every poll)."""
        if self.standby is not None:
            try:
                self.standby.check([self._key("nonce")])
                return
            except Exception as exc:  # noqa: BLE001
                if not lost(exc):
                    raise
                self._drop_standby()
        key = self._key(f"standby/{self.slot}")
        if not self.check([key]):
            dead = set(self.dead()) | {self.host}
            elected = min((r for r in range(self.size) if r not in dead), default=None)
            if elected != self.rank or self._failed_slot == self.slot:
                return
            try:
                self._host_standby(key)
            except Exception as exc:  # noqa: BLE001 - never end the rank over its standby
                if self._primary_lost_in(exc):  # the store itself is gone: the monitor's
                    raise
                self._failed_slot = self.slot
                _note(self.rank, f"could not start a standby store ({type(exc).__name__}: "
                                 f"{exc}); the store's host is a single point of failure "
                                 f"again")
            return
        rank, addr, port = _text(self.get(key)).split()
        if int(rank) == self.rank:  # announced by this rank (refresh after a failure)
            return
        try:
            client = _open(addr, int(port), CONNECT_S)
        except Exception:  # noqa: BLE001 - its host died before we connected: skip it
            _note(self.rank, f"could not connect to rank {rank}'s standby store "
                             f"({addr}:{port}); passing it over")
            self.slot += 1
            return
        client.set_timeout(datetime.timedelta(seconds=self.timeout))
        self._attach(client, int(rank), (addr, int(port)))

    def _host_standby(self, key: str) -> None:
        from torch.distributed import TCPStore
        addr = local_address(*self.address)
        server = TCPStore(addr, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=self.timeout))
        for name in self.shared_keys():
            k = self._key(name)
            if self.check([k]):
                server.set(k, self.get(k))
        mine = f"{self.rank} {addr} {server.port}"
        if _text(self.compare_set_primary(key, mine)) != mine:
            return  # another rank announced first: connect to its store on the next poll
        self.servers.append(server)
        self._attach(server, self.rank, (addr, int(server.port)))

    def compare_set_primary(self, key: str, value: str) -> Any:
        """``compare_set(key, "", value)`` on the primary only (the announcement)."""
        return self._primary("compare_set", key, "", value)

    def _attach(self, client: Any, rank: int, address: tuple[str, int]) -> None:
        try:
            for method, args in list(self.log.values()):
                getattr(client, method)(*args)
        except Exception as exc:  # noqa: BLE001 - its host died meanwhile: pass it over
            if not lost(exc):
                raise
            self.slot += 1
            return
        self.standby, self.standby_host, self.standby_address = client, rank, address

    def urgent(self) -> bool:
        """Whether to refresh now rather than at the next poll: the store's host is known
        dead, or no standby is in place although a rank could host it (no store operation:
        a read of this process's dead set)."""
        dead = set(self.dead())
        if self.host in dead:
            return True
        return self.standby is None and self._failed_slot != self.slot and \
            any(r not in dead and r != self.host for r in range(self.size))

    def hosts_a_store(self) -> bool:
        """Whether another rank may be using a store this rank hosts."""
        return bool(self.servers)

    def _key(self, name: str) -> str:
        return f"{self.ns}/{name}"


def _open(addr: str, port: int, timeout: float) -> Any:
    from torch.distributed import TCPStore
    return TCPStore(addr, port, is_master=False, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout))


def _note(rank: int, text: str) -> None:
    try:
        sys.stderr.write(f"[commlib] rank {rank}: {text}\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass
