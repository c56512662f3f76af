"""commlib.fault.ft_backend: each MPI implementation gets its fault-tolerance backend (MPICH:
commlib's own detection with the launcher's list; Open MPI: ULFM; Intel MPI: commlib's own
detection on one machine; anything else: refused), and the refusals say which library, why
and what to use instead. One process; the multi-rank behaviour is tests/test_elastic_ft.py
(the launch without ULFM refused on every rank included)."""
from __future__ import annotations

import time

import pytest
from mpi4py import MPI

from commlib.base.errors import CommError
from commlib.fault import ft_backend
from commlib.mpi import mpi_impl
from commlib.mpi.mpi_impl import identify

TEXTS = {
    "mpich": "MPICH Version:      5.0.2\nMPICH Release date: Mon Jun  2 2026\n",
    "openmpi": "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11",
    "intel": "Intel(R) MPI Library 2021.18.1 for Linux* OS\n",
    "unknown": "Some MPI 1.0",
}


@pytest.mark.parametrize("key,backend", [("mpich", ft_backend.Pmi),
                                         ("openmpi", ft_backend.Ulfm),
                                         ("intel", ft_backend.Local),
                                         ("unknown", ft_backend.Refused)])
def test_each_implementation_gets_its_backend(monkeypatch, key, backend):
    monkeypatch.setattr(mpi_impl, "_current", identify(TEXTS[key]))
    monkeypatch.setattr(ft_backend, "_backend", None)
    assert type(ft_backend.backend()) is backend
    assert ft_backend.backend().impl.key == key


def test_a_refused_library_is_named_with_the_reason_and_what_to_use():
    refused = ft_backend.Refused(identify(TEXTS["unknown"]))
    with pytest.raises(CommError, match=r"not available on Some MPI 1\.0.*mpich wheel.*"
                                        r"--with-ft ulfm"):
        refused.check(True, False, 4)


def test_intel_mpi_is_refused_beyond_one_machine():
    """Its launcher reports no death: only the peers of this machine can be watched."""
    local = ft_backend.Local(identify(TEXTS["intel"]))
    with pytest.raises(CommError, match=r"Intel MPI 2021\.18\.1 needs every rank on one "
                                        r"machine: its launcher does not report dead"):
        local.check(False, False, 4)
    local.check(True, False, 4)   # every peer on this machine
    local.check(False, True, 4)   # a store-backed world: heartbeats across hosts
    local.check(False, False, 1)


def test_ulfm_never_calls_the_mpich_ctypes_reader():
    """``MPIX_Comm_get_failed`` through ctypes takes MPICH's ``int`` handles; Open MPI's are
    pointers (the call segfaulted there): ULFM reads mpi4py's ``Comm.Get_failed``."""
    assert isinstance(ft_backend.Ulfm(identify(TEXTS["openmpi"])).detector(),
                      ft_backend.UlfmFailed)
    assert ft_backend.Local(identify(TEXTS["intel"])).detector() is None
    pmi = ft_backend.Pmi(identify(TEXTS["mpich"]))
    if mpi_impl.current().abi == "mpich":
        assert isinstance(pmi.detector(), (ft_backend.Mpix, type(None)))


@pytest.mark.skipif(MPI.ERR_PROC_FAILED == MPI.ERR_UNKNOWN,
                    reason="this MPI library has no ULFM error classes")
def test_ulfm_failure_errors():
    ulfm = ft_backend.Ulfm(identify(TEXTS["openmpi"]))
    for cls in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED):
        assert ulfm.failure_error(MPI.Exception(cls))
    assert not ulfm.failure_error(MPI.Exception(MPI.ERR_OTHER))
    assert not ulfm.failure_error(ValueError("not MPI"))
    # another class on a revoked communicator (libnbc's "Error in NBC_Start_round"
    # reports MPI_ERR_OTHER) is the failure too; on a sound one it is not
    revoked, sound = MPI.COMM_SELF.Dup(), MPI.COMM_SELF.Dup()
    revoked.Revoke()
    assert ulfm.failure_error(MPI.Exception(MPI.ERR_OTHER), revoked)
    assert not ulfm.failure_error(MPI.Exception(MPI.ERR_OTHER), sound)
    assert not ft_backend.Pmi(identify(TEXTS["mpich"])).failure_error(
        MPI.Exception(MPI.ERR_PROC_FAILED))


def test_the_ulfm_launch_is_read_from_mpi_t():
    """Open MPI's ``mpi_ft_enable`` (what ``--with-ft ulfm`` sets) is off in this process
    (not launched so); an unknown variable reads as None; a world of one is never refused."""
    assert ft_backend.cvar_true("commlib_no_such_variable") is None
    if mpi_impl.current().key == "openmpi":
        assert ft_backend.cvar_true("mpi_ft_enable") is False
    ft_backend.Ulfm(identify(TEXTS["openmpi"])).check(True, False, 1)


def test_control_messages_skip_the_dead_and_probe_on(monkeypatch):
    """The agreement's and exit path's calls: a send the library refuses (a peer it knows
    dead) is skipped, a probe refused until failures are acknowledged is acknowledged and
    probed again; other errors are raised."""
    failed = MPI.Exception(MPI.ERR_PROC_FAILED)

    class Backend(ft_backend.Backend):
        acked = 0

        def failure_error(self, exc, comm=None):
            return exc is failed

        def acknowledge(self, comm):
            Backend.acked += 1

    class Comm:
        probes = 0

        def isend(self, obj, dest, tag):
            raise failed

        def Iprobe(self, source, tag, status):
            Comm.probes += 1
            if Comm.probes == 1:
                raise failed
            return False

    monkeypatch.setattr(ft_backend, "_backend", Backend(identify(TEXTS["openmpi"])))
    assert ft_backend.isend(Comm(), "x", 1, 5) is None
    assert ft_backend.sent(None)
    assert ft_backend.iprobe_any(Comm(), 5, None) is False
    assert (Comm.probes, Backend.acked) == (2, 1)

    class Broken(Comm):
        def isend(self, obj, dest, tag):
            raise MPI.Exception(MPI.ERR_OTHER)

    with pytest.raises(MPI.Exception):
        ft_backend.isend(Broken(), "x", 1, 5)


def test_a_blocking_call_on_a_helper_thread_is_bounded(monkeypatch):
    """``fault_tolerance.in_thread`` (communicator creation, the survivors' one included,
    which the watchdog does not see): a call that neither ends nor fails within
    ``COMMLIB_TIMEOUT`` raises CommError instead of hanging; one that returns is returned."""
    import threading
    import time

    from commlib.base.options import options
    from commlib.fault import fault_tolerance

    class Alive:
        failed = False

    monkeypatch.setattr(options, "timeout", 0.3)
    start = time.monotonic()
    with pytest.raises(CommError, match=r"MPI Comm_create_group did not complete within "
                                        r"0\.3 s \(COMMLIB_TIMEOUT\)"):
        fault_tolerance.in_thread(Alive(), "Comm_create_group", threading.Event().wait, 5)
    assert time.monotonic() - start < 3
    assert fault_tolerance.in_thread(Alive(), "Comm_create_group", lambda x: x + 1, 1) == 2
    # A caller that retries (the survivors' creation) gives one attempt a shorter limit.
    monkeypatch.setattr(options, "timeout", 60)
    start = time.monotonic()
    with pytest.raises(fault_tolerance.CallTimedOut, match=r"within 0\.2 s \(this attempt"):
        fault_tolerance.in_thread(Alive(), "Comm_create_from_group", threading.Event().wait,
                                  5, limit_s=0.2)
    assert time.monotonic() - start < 3


def test_a_call_given_up_on_keeps_its_own_group():
    """``fault_tolerance.in_thread`` hands its helper thread a copy of each MPI group (and
    info) among the arguments: a caller frees its group once the call is given up on (a
    peer died: ``ft._agree_and_create``'s ``finally``), while the call still runs inside
    MPI, and MPICH's ``MPI_Comm_create_group`` reads its group until it returns (a freed
    one: MPICH's assertion in ``allreduce_group.c``, or a segfault; measured with the
    survivors' creation given up on 1 ms in at 3 ranks). Here the call outlives the give-up
    and reads its group after the caller freed its own: it sees the group; the copy is
    freed when the call returns. Negative control: the caller's freed group is unusable."""
    import threading

    from commlib.base.errors import PeerFailure
    from commlib.fault import fault_tolerance

    release, returned = threading.Event(), threading.Event()
    seen: list = []

    def call(group, info):
        release.wait(10)
        seen.extend([group.Get_size(), info.Get("commlib_test"), group])
        returned.set()
        return None

    class Dying:
        failed = False

        def failure(self, op):
            return PeerFailure(f"given up on {op}", failed=[1])

    comm = Dying()
    group = MPI.COMM_WORLD.Get_group()
    info = MPI.Info.Create()
    info.Set("commlib_test", "kept")
    threading.Timer(0.05, lambda: setattr(comm, "failed", True)).start()
    with pytest.raises(PeerFailure, match="given up on Comm_create_group"):
        fault_tolerance.in_thread(comm, "Comm_create_group", call, group, info)
    group.Free()  # as the caller does, the call still running
    info.Free()
    with pytest.raises(MPI.Exception):  # the negative control: the caller's is gone
        group.Get_size()
    release.set()
    assert returned.wait(10)
    assert seen[:2] == [MPI.COMM_WORLD.Get_size(), "kept"], seen
    deadline = time.monotonic() + 5  # (freed by the helper thread just after the call)
    while seen[2] != MPI.GROUP_NULL and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen[2] == MPI.GROUP_NULL, "the copy was not freed after the call"
