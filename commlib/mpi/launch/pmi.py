"""A PMI-1 server for one MPI process, over one end of a socket pair.

MPICH's PMI-1 client (``src/pmi/src/pmi_v1.c``; wire format ``pmi_wire.c``; messages
``src/pmi/maint/pmi-1.1.txt``; Flux RFC 13) talks to its process manager through the
socket named by ``PMI_FD``, one line per message: ``cmd=NAME key=value ...\\n``; values end
at a space (the client never escapes them; a reply may escape a space or a backslash with
a backslash). The server answers as hydra's proxy does, as PMI version 1.1 (so the client
uses neither threaded requests nor group barriers):

============================  ===============================================================
query                         reply
============================  ===============================================================
``init``                      ``response_to_init pmi_version=1 pmi_subversion=1``
``get_maxes``                 ``maxes kvsname_max=256 keylen_max=64 vallen_max=1024``
``get_appnum``                ``appnum appnum=0``
``get_my_kvsname``            ``my_kvsname kvsname=...``
``get_universe_size``         ``universe_size size=N``
``put key value``             ``put_result`` (keys starting ``PMI_`` are refused, as hydra does)
``get key``                   ``get_result found=TRUE value=...``; ``PMI_process_mapping`` and
                              ``PMI_dead_processes`` come from :class:`Space`; other
                              missing keys ``rc=1 msg=key_not_found`` (as hydra)
``barrier_in``                ``barrier_out`` once every rank entered
``finalize``                  ``finalize_ack``
``abort exitcode=N``          no reply: :meth:`Space.abort`
``spawn``, ``publish_name``,  ``rc=1`` with a message: not provided
``lookup_name``...
============================  ===============================================================

Every reply carries ``rc=0`` unless it failed. The key-value space and the barrier are a
:class:`Space` (see :mod:`commlib.mpi.launch.space`), shared by every rank's server.
"""
from __future__ import annotations

import os
import select
import socket
import sys
import threading
from typing import Protocol

KVSNAME_MAX, KEYLEN_MAX, VALLEN_MAX = 256, 64, 1024
_UNSUPPORTED = {"spawn": "spawn_result", "publish_name": "publish_result",
                "unpublish_name": "unpublish_result", "lookup_name": "lookup_result"}


class Space(Protocol):
    """What a server needs from the job's shared state (one per rank, same namespace)."""

    kvsname: str
    size: int

    def put(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> str | None: ...
    def barrier(self) -> None: ...                  # raises TimeoutError naming the absent
    def process_mapping(self) -> str: ...
    def dead_processes(self) -> str: ...
    def abort(self, code: int, message: str) -> None: ...


def parse(line: str) -> tuple[str, dict[str, str]]:
    """``cmd=NAME k=v ...`` -> (NAME, {k: v}); a value runs to the next space."""
    fields: dict[str, str] = {}
    for token in line.split(" "):
        if not token:
            continue
        key, _, value = token.partition("=")
        fields[key] = value
    return fields.pop("cmd", fields.pop("mcmd", "")), fields


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace(" ", "\\ ")


def format_reply(cmd: str, rc: int = 0, **fields: object) -> bytes:
    """One reply line: ``cmd=NAME k=v ... rc=RC\\n`` (values escaped)."""
    parts = [f"cmd={cmd}"] + [f"{k}={_escape(str(v))}" for k, v in fields.items()]
    parts.append(f"rc={rc}")
    return (" ".join(parts) + "\n").encode()


class Server:
    """Serves one client (this process's libmpi) until :meth:`stop` or until the client
    closes its end. Runs in a thread of the process: MPI must then be initialized and
    finalized without the GIL held (through ctypes), or this thread could not answer."""

    def __init__(self, sock: socket.socket, space: Space, rank: int) -> None:
        self.sock, self.space, self.rank = sock, space, rank
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="commlib-pmi", daemon=True)
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self.finalized = False
        self.queries = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop serving (the socket stays open); True when the thread has ended."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        buf = b""
        try:
            while True:
                ready, _, _ = select.select([self.sock, self._wake_r], [], [])
                if self._wake_r in ready:
                    return
                data = self.sock.recv(1 << 16)
                if not data:
                    return
                buf += data
                while True:
                    if buf.startswith(b"mcmd="):  # multi-line spawn: up to "endcmd"
                        end = buf.find(b"endcmd\n")
                        if end < 0:
                            break
                        buf = buf[end + len(b"endcmd\n"):]
                        self._send(format_reply("spawn_result", rc=1,
                                                msg=self._unsupported("spawn")))
                        continue
                    nl = buf.find(b"\n")
                    if nl < 0:
                        break
                    line, buf = buf[:nl].decode("utf-8", "replace"), buf[nl + 1:]
                    if line.strip():
                        self._handle(*parse(line.strip()))
        except BaseException as exc:  # noqa: BLE001 - reported, and the client sees EOF
            self.error = exc
            _note(self.rank, f"PMI server stopped: {type(exc).__name__}: {exc}")
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # libmpi's next read fails, not hangs
            except OSError:
                pass

    def _send(self, data: bytes) -> None:
        with self._lock:
            self.sock.sendall(data)

    def _unsupported(self, what: str) -> str:
        return f"{what}_is_not_provided_by_commlib_store-backed_PMI"

    def _handle(self, cmd: str, f: dict[str, str]) -> None:
        self.queries += 1
        space = self.space
        if cmd == "init":
            reply = format_reply("response_to_init", pmi_version=1, pmi_subversion=1)
        elif cmd == "get_maxes":
            reply = format_reply("maxes", kvsname_max=KVSNAME_MAX, keylen_max=KEYLEN_MAX,
                                 vallen_max=VALLEN_MAX)
        elif cmd == "get_appnum":
            reply = format_reply("appnum", appnum=0)
        elif cmd == "get_my_kvsname":
            reply = format_reply("my_kvsname", kvsname=space.kvsname)
        elif cmd == "get_universe_size":
            reply = format_reply("universe_size", size=space.size)
        elif cmd == "put":
            key = f.get("key", "")
            if key.startswith("PMI_"):
                reply = format_reply("put_result", rc=1, msg="Keys_with_PMI_prefix_are_reserved")
            else:
                space.put(key, f.get("value", ""))
                reply = format_reply("put_result")
        elif cmd == "get":
            key = f.get("key", "")
            if key == "PMI_process_mapping":
                try:
                    value: str | None = space.process_mapping()
                except TimeoutError as exc:  # a rank never arrived: MPI_Init fails, saying so
                    _note(self.rank, str(exc))
                    value = None
            elif key == "PMI_dead_processes":
                value = space.dead_processes()
            elif key.startswith("PMI_"):
                value = None
            else:
                value = space.get(key)
            reply = (format_reply("get_result", found="TRUE", value=value) if value is not None
                     else format_reply("get_result", rc=1, msg="key_not_found"))
        elif cmd == "barrier_in":
            try:
                space.barrier()
                reply = format_reply("barrier_out")
            except TimeoutError as exc:
                _note(self.rank, str(exc))
                reply = format_reply("barrier_out", rc=1, msg="barrier_timed_out")
        elif cmd == "finalize":
            self.finalized = True
            reply = format_reply("finalize_ack")
        elif cmd == "abort":
            try:
                code = int(f.get("exitcode", "1"))
            except ValueError:
                code = 1
            space.abort(code, f.get("message", ""))
            return  # the client exits without waiting for a reply
        elif cmd in _UNSUPPORTED:
            reply = format_reply(_UNSUPPORTED[cmd], rc=1, msg=self._unsupported(cmd))
        else:
            _note(self.rank, f"unknown PMI command {cmd!r} {f}")
            reply = format_reply(f"{cmd}_result", rc=1, msg="unknown_command")
        self._send(reply)


def _note(rank: int, text: str) -> None:
    try:
        sys.stderr.write(f"[commlib] rank {rank}: {text}\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - diagnostics never raise
        pass
