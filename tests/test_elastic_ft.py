"""Fault-tolerant groups under real failures (issue 21 section 1): ``elastic_ft_program.py``
jobs of 4 ranks on the MPI implementation under test, launched so that a rank can die alone
(:func:`elastic_common.per_rank_hosts`: on MPICH one hydra proxy per rank and
``-disable-auto-cleanup``, on Open MPI ``--with-ft ulfm``, on Intel MPI
``-disable-auto-cleanup``), each under an outer timeout. Every survivor must get
:class:`commlib.PeerFailure`, shrink, agree on the iteration (at most one apart), and finish
with every later collective exact; nothing may hang, no process of the job may be left, no
shared-memory segment of the job may stay in ``/dev/shm``.

Cases: SIGKILL of one rank (the last, or rank 0), ``os._exit`` of one, an ordinary ``sys.exit(0)`` of one (which
must count as dead), two successive kills, a second death inside the survivors' agreement,
one while they build their communicator, and a creation that never returns on every
survivor (given up and built again). Negative controls: the same kill with fault
tolerance off ends the job, under today's launch (one proxy: the launcher kills every rank)
and under the per-rank launch (the survivors wait until the watchdog aborts the job, or
under ULFM the MPI error aborts it).
"""
from __future__ import annotations

import os

import pytest

from commlib.fault import ft_backend
from elastic_common import (
    HERE,
    fault_tolerant_launch,  # noqa: F401 - skips where refused
    leftover_shm,
    results,
    run_job,
    run_job_past_known_crash,
)
from helpers import mpi_impl, serial_only

PROGRAM = os.path.join(HERE, "elastic_ft_program.py")
N = 4
OUTER_S = 90
pytestmark = [serial_only, pytest.mark.timeout(600),
              pytest.mark.usefixtures("fault_tolerant_launch")]

# case -> (survivors, sizes of the groups a survivor goes through)
CASES = {
    "kill": ([0, 1, 2], [4, 3]),
    "kill0": ([1, 2, 3], [4, 3]),  # rank 0 SIGKILLed
    "exit": ([0, 1, 2], [4, 3]),
    "sysexit": ([0, 1, 2], [4, 3]),
    "two": ([0, 1], [4, 3, 2]),
    "during": ([0, 1], [4, 2]),
    "creating": ([0, 1], [4, 2]),
    "stuck": ([0, 1, 2], [4, 3]),
}


def check_job(tmp_path, case: str, status: int, out: str, left: list[int]) -> dict[int, dict]:
    survivors, sizes = CASES[case]
    assert status != -9, f"{case}: hang (killed after {OUTER_S} s)\n{out[-3000:]}"
    assert not left, f"{case}: processes {left} of the job were left running"
    assert not leftover_shm(str(tmp_path)), f"{case}: left {leftover_shm(str(tmp_path))}"
    found = results(str(tmp_path))
    assert sorted(found) == survivors, f"{case}: ranks {sorted(found)} finished, expected " \
                                       f"{survivors}\n{out[-3000:]}"
    for rank, data in found.items():
        assert data["iters"] == 60, f"{case} rank {rank}: stopped at {data['iters']}"
        # one machine: the deaths are seen from the process ids, never by asking the
        # launcher (on MPICH a rank dying mid-request would end the job;
        # commlib.fault.failure_detection)
        assert data["polls"] > 0 and data["launcher_reads"] == 0, (case, rank, data)
        if mpi_impl().fault_tolerance == "ulfm":
            # revoking the communicator brought every waiter given up on back from MPI
            # (whether a survivor's wait was ended by the library, by the revoke or not at
            # all, as when it noticed the death between two operations, is timing)
            assert data["waits"]["left_in_mpi"] == 0, (case, rank, data["waits"])
        assert [g["size"] for g in data["groups"]] == sizes, (case, rank, data["groups"])
        for g in data["groups"][1:]:
            assert g["ranks"] == survivors or len(g["ranks"]) > len(survivors), (case, g)
            assert "recovery_s" in g, f"{case} rank {rank}: no collective after the shrink"
    # The same agreement everywhere.
    for i in range(1, len(sizes)):
        seen = {str(found[r]["groups"][i]["values"]) for r in survivors}
        assert len(seen) == 1, f"{case}: survivors agreed differently: {seen}"
    return found


@pytest.mark.parametrize("case", sorted(CASES))
def test_survivors_go_on(tmp_path, case):
    argv = ["kill", "--victim-rank", "0"] if case == "kill0" else [case]
    # (run once more where Open MPI crashed as it is known to: elastic_common)
    status, seconds, out, left = run_job_past_known_crash(str(tmp_path), N, [PROGRAM] + argv,
                                                          OUTER_S, COMMLIB_TIMEOUT="60")
    found = check_job(tmp_path, case, status, out, left)
    if case == "stuck":  # the first creation was given up, the second built the group;
        # under ULFM the duplicate of the group is built by name too: its first attempt,
        # stuck on survivor 0, was given up by all and the second built it
        # (two attempts), and the split's members build theirs by name (one attempt)
        ulfm = ft_backend.backend().derive_by_create
        assert {r: found[r]["creations"] for r in found} == \
            {r: 2 + (2 + (r != 0) if ulfm else 0) for r in (0, 1, 2)}, found
        assert all(found[r]["groups"][1]["dup_s"] > 0 for r in found), found
        assert {r: found[r]["groups"][1]["split"] for r in found} == \
            {0: False, 1: True, 2: True}, found


@pytest.mark.parametrize("postponed", [True, False], ids=["postponed", "control"])
def test_creations_retried_inside_a_collective_postpone_its_deadline(tmp_path, postponed):
    """Under ULFM, where every communicator made after a failure is built by name with
    attempts that each bound themselves (``create_limit()``): the survivors' first
    allreduce makes the shared-memory window (``COMMLIB_SHM=1``) and its communicators under
    that allreduce's deadline (``COMMLIB_TIMEOUT=12``); the first attempts at the first two
    never return on any survivor (10 s each, given up). The creations postpone the
    deadline, so the third attempt builds it and every survivor finishes exact (CI once
    saw a window's deadline end a job whose creations were still retrying). Negative
    control (``--no-postpone``): the deadline passes during the second stuck attempt and
    the watchdog aborts the job, no survivor finishing."""
    if not ft_backend.backend().derive_by_create:
        pytest.skip("communicators made after a failure are built by name only under ULFM")
    argv = [PROGRAM, str(tmp_path), "stuck_window"] + ([] if postponed else ["--no-postpone"])
    status, _, out, left = run_job(N, argv, OUTER_S, COMMLIB_TIMEOUT="12", COMMLIB_SHM="1")
    assert not left and not leftover_shm(str(tmp_path)), (left, out[-2000:])
    found = results(str(tmp_path))
    if not postponed:
        assert status == 70 and not found, (status, sorted(found), out[-2000:])
        assert "shared-memory window" in out and "did not complete within 12 s" in out, \
            out[-2000:]
        return
    assert status != -9 and sorted(found) == [0, 1, 2], (status, sorted(found), out[-3000:])
    for rank, data in found.items():
        assert data["iters"] == 60 and [g["size"] for g in data["groups"]] == [4, 3], data
        # two first attempts given up, each built again: at least 4 creations by name
        assert data["creations"] >= 4, data


# How the kill ends a job without fault tolerance, per implementation (measured). The plain
# launch: the launcher ends every rank (hydra's proxy SIGKILLs them: 9; PRRTE: 137; Intel's
# hydra: 255). The keep-running launch: commlib's detection off, the survivors wait in their
# allreduce until the watchdog aborts the job (70), or, under ULFM, the allreduce raises
# MPI_ERR_PROC_FAILED and the uncaught exception aborts the job (1).
PLAIN_KILL_STATUS = {"mpich": 9, "openmpi": 137, "intel": 255}
KEPT_RUNNING = {"pmi": (70, "did not complete within 4 s"),
                "local": (70, "did not complete within 4 s"),
                "ulfm": (1, "MPI_ERR_PROC_FAILED")}


def test_without_fault_tolerance_the_kill_ends_the_job(tmp_path):
    """Negative control: fault tolerance off. Today's launch (one launcher daemon for the
    host): the launcher ends every rank; the keep-running launch (one failure domain per
    rank): the watchdog ends the job (or the MPI error does, under ULFM). No survivor
    finishes."""
    impl = mpi_impl()
    status, _, out, left = run_job(N, [PROGRAM, str(tmp_path), "kill", "--no-ft"], OUTER_S,
                                   per_rank=False, COMMLIB_TIMEOUT="60")
    assert status == PLAIN_KILL_STATUS.get(impl.key, status) and status not in (0, -9), \
        (status, out[-2000:])
    assert not results(str(tmp_path)) and not left, (status, out[-2000:])
    code, text = KEPT_RUNNING[impl.fault_tolerance]
    status, _, out, left = run_job(N, [PROGRAM, str(tmp_path), "kill", "--no-ft"], OUTER_S,
                                   COMMLIB_TIMEOUT="4")
    assert status == code and not results(str(tmp_path)) and not left, (status, out[-2000:])
    assert text in out, out[-2000:]
    assert not leftover_shm(str(tmp_path))


def test_a_launch_that_cannot_survive_a_death_is_refused_at_init(tmp_path):
    """Open MPI launched without ``--with-ft ulfm`` (its MPI_T variable ``mpi_ft_enable``
    off: a dead rank would end the whole job): fault-tolerant mode raises CommError at
    ``init`` on every rank, naming the launch option; the job ends with status 1, nothing
    hangs or is left. MPICH's and Intel MPI's hydra tell their ranks nothing of
    ``-disable-auto-cleanup``: skipped there."""
    import re
    impl = mpi_impl()
    if not impl.keep_running_cvar:
        pytest.skip(f"{impl.describe()}'s launcher does not tell its ranks whether a dead "
                    f"rank ends the job")
    status, _, out, left = run_job(3, [PROGRAM, str(tmp_path), "kill"], OUTER_S,
                                   per_rank=False, COMMLIB_TIMEOUT="60")
    assert status == 1 and not left and not results(str(tmp_path)), (status, out[-2000:])
    option = " ".join(impl.keep_running_args)
    refused = re.findall(rf"CommError: commlib.init \(rank (\d)\): fault-tolerant mode on "
                         rf"{re.escape(impl.describe())} .*`mpirun {option} -n N", out)
    assert sorted(refused) == ["0", "1", "2"], out[-3000:]


def test_only_the_known_open_mpi_crash_gets_a_second_run(monkeypatch):
    """The second run of ``run_job_past_known_crash`` is for Open MPI's segfault inside
    ``MPI_Comm_create_from_group`` and its creation stalling in every attempt alone:
    another crash, the same frames without a segfault, a stall that a later attempt got
    past, a creation that found a peer dead, or the same output under another MPI is
    judged as it is."""
    import types

    import elastic_common
    crash = ("[vm:1] *** Process received signal ***\n[vm:1] Signal: Segmentation fault (11)\n"
             "[vm:1] [13] /x/libmpi.so.40(ompi_comm_create_from_group+0x15b)[0x7f]\n")
    stall = ("commlib.fault.helper_thread.CallTimedOut: commlib (rank 1): MPI "
             "Comm_create_from_group of group[0, 1, 3]/node (group) did not complete within "
             "15 s with no peer dead, attempt 3 of 3\n")
    retried = ("commlib (rank 1): MPI Comm_create_from_group (group) did not complete within "
               "15 s with no peer dead; building it again under a new name (attempt 3 of 3)\n")
    for key, out, named in [
            ("openmpi", crash, True),
            ("openmpi", crash.replace("ompi_comm_create_from_group", "ompi_coll_base_x"), False),
            ("openmpi", crash.replace("Segmentation fault", "Aborted"), False),
            ("mpich", crash, False),
            # every attempt at a creation by name stalled (the message FTComm._create raises)
            ("openmpi", stall, True), ("mpich", stall, False),
            # a stall the next attempt got past, or one that did not reach the last attempt
            ("openmpi", retried, False), ("openmpi", stall.replace("3 of 3", "2 of 3"), False),
            ("openmpi", stall.replace("no peer dead", "rank 2 dead"), False)]:
        monkeypatch.setattr(elastic_common, "mpi_impl", lambda k=key: types.SimpleNamespace(key=k))
        assert (elastic_common.known_library_crash(out) is not None) == named, (key, out)


def test_hydra_ending_the_job_gets_a_second_run_only_where_no_rank_finished(tmp_path,
                                                                           monkeypatch):
    """MPICH's launcher ending the whole job itself (a failed signal to a proxy) gets a
    second run where no rank finished; not where ranks finished (status 255 with their
    results: judged as it is), not without every line of it, not under another MPI."""
    import types

    import elastic_common
    out = ("[mpiexec@vm] HYD_pmcd_pmiserv_send_signal (pmiserv_cb.c:218): unable to write\n"
           "[mpiexec@vm] control_cb (pmiserv_cb.c:458): unable to send SIGUSR1 downstream\n"
           "[mpiexec@vm] main (mpiexec.c:270): process manager error waiting for completion\n")
    empty, finished = tmp_path / "empty", tmp_path / "finished"
    empty.mkdir()
    finished.mkdir()
    (empty / "shm0.json").write_text("{}")
    (finished / "rank0.json").write_text("{}")
    for key, text, folder, named in [
            ("mpich", out, empty, True), ("mpich", out, finished, False),
            ("mpich", out.replace("SIGUSR1", "SIGTERM"), empty, False),
            ("openmpi", out, empty, False)]:
        monkeypatch.setattr(elastic_common, "mpi_impl", lambda k=key: types.SimpleNamespace(key=k))
        found = elastic_common.known_launcher_failure(text, str(folder))
        assert (found is not None) == named, (key, folder.name, text)


def test_the_second_run_replaces_the_first(tmp_path, monkeypatch):
    """``run_job_past_known_crash``: after the known crash the first run's files (and its
    whole output) move to ``first-run/``, the job runs once more in the same folder and
    that run is returned; a run without the crash, or with another one, is returned as
    it is (one run)."""
    import contextlib
    import types

    import elastic_common
    monkeypatch.setattr(elastic_common, "mpi_impl", lambda: types.SimpleNamespace(key="openmpi"))
    crash = "Signal: Segmentation fault (11)\n[13] libmpi.so(ompi_comm_create_from_group+0x1)\n"
    for outputs, runs in [([crash, "ok"], 2), (["ok"], 1),
                          (["Signal: Segmentation fault (11)\n"], 1)]:
        folder = tmp_path / f"case{runs}{len(outputs[0])}"
        folder.mkdir()
        calls = []

        def fake(n, argv, timeout, outputs=outputs, calls=calls, **kwargs):
            calls.append(argv)
            (folder / f"rank{len(calls)}.json").write_text("{}")
            return 0, 1.0, outputs[len(calls) - 1], []
        monkeypatch.setattr(elastic_common, "run_job", fake)
        with (pytest.warns(UserWarning, match="run again") if runs == 2
              else contextlib.nullcontext()):
            status, _, out, left = elastic_common.run_job_past_known_crash(
                str(folder), 3, ["prog.py", "--x"], 10)
        assert len(calls) == runs and out == outputs[-1] and status == 0 and not left
        assert all(a == ["prog.py", str(folder), "--x"] for a in calls), calls
        if runs == 2:
            assert sorted(p.name for p in folder.iterdir()) == ["first-run", "rank2.json"]
            assert (folder / "first-run" / "output.txt").read_text() == crash
            assert (folder / "first-run" / "rank1.json").exists()
