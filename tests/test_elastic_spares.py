"""Warm spares (issue 34 part 1): ``commlib.elastic.run(spares=K)`` jobs of
``elastic_train_program.py`` (float64 MLP, SGD with momentum, the global batch of 24 split
over the trainers), ``N + K`` ranks launched so that one can die alone
(``elastic_common.run_job``: on MPICH one hydra proxy per rank and ``-disable-auto-cleanup``),
each under an outer timeout; the job's status is checked, no process may be left, no
shared-memory segment may stay in ``/dev/shm``.

With a spare the group is back at ``N`` trainers after the agreed step, so every trainer's
final parameters must equal, bit for bit, those of the ``N``-rank run without any failure
(the reference: the ledger says which group size applied each step, always ``N``). Cases:
SIGKILL of a trainer mid-backward (3+1: the spare joins); SIGKILL of rank 0 (3+2: the
first spare joins, the second is released at the end and leaves); a spare SIGKILLed while
standing by, then a trainer (3+2: the trainers recover among themselves, the dead spare
is passed over, the second spare joins); a spare SIGKILLed at each point of its joining
(3+2: the survivors, and the spare where it is already a member of the merged group,
recover again and the second spare joins; 3+1: the only spare dies half way through the
state: the survivors go on at reduced strength, exact against the run shrunk at the agreed
step); a survivor SIGKILLed while a spare joins (3+2: the half-joined spare recovers with
the other survivor and trains; it hung before); the spare used up, then a second trainer
killed: with ``replace=True`` a replacement is spawned (3+1: back at 3 ranks, exact); with
``replace=True`` and no spare, a second death while the replacement joins (the replacement
itself, or the survivor about to send it the state) or after it joined (the replacement, or
rank 0): the living spawn again and end back at 3, exact;
``spares`` larger than the job refused on every rank; in the store-backed world
(``commlib.mpi.launch``, rank 0 hosting the store), a spare replaces a killed trainer (3+1,
exact). On Open MPI (``--with-ft ulfm``) the joining cases hung until the communicators
made after a failure were built without Open MPI's context-id allocator (a death during an
``MPI_Comm_idup`` leaves it stuck: see :mod:`commlib.fault.ft_backend`); tests/run_all.sh
runs this file on MPICH, and its joining, replacement and refill cases on Open MPI (the
whole file passed there too). A spawned refill of the pool (``refill=True``, 3+1): the
refilled spare meets the second death. Negative control: a joining spare that keeps its
own model instead of the state it received (``--skip-spare-state``): the check must see the
difference.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from elastic_common import (
    TRAIN_PROGRAM,
    excerpt,
    fault_tolerant_launch,  # noqa: F401 - skips where refused
    leftover_shm,
    params,
    rank_hosts,
    results,
    run_job,
    run_job_past_known_crash,
    run_store_job,
)
from helpers import mpi_impl, requires_store_world, serial_only

STEPS = 30
OUTER_S = 120
pytestmark = [serial_only, pytest.mark.timeout(600),
              pytest.mark.usefixtures("fault_tolerant_launch")]

# The job's status per implementation (measured on MPICH: hydra reports the SIGKILLed rank's
# signal, 9; with -disable-auto-cleanup it ends now and then a job whose ranks all exited
# with status 255 instead, "unable to send SIGUSR1 downstream", see elastic_common.run_job)
KILLED = {"mpich": (9, 255)}
CLEAN = {"mpich": (0, 255)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, dict]:
    """The 3-rank run without fault tolerance and without failure."""
    out = tmp_path_factory.mktemp("spares-reference")
    scenario = [{"name": "s0", "algorithm": "gradient_allreduce", "victims": "", "steps": ""}]
    status, _, text, left = run_job(3, [TRAIN_PROGRAM, str(out), "--steps", str(STEPS),
                                        "--scenarios", json.dumps(scenario)], OUTER_S,
                                    keep_running=False, COMMLIB_TIMEOUT="60")
    assert status == 0 and not left, f"reference failed ({status})\n{text[-3000:]}"
    found = results(str(out / "s0"))
    assert sorted(found) == [0, 1, 2], found.keys()
    return found


def job(tmp_path, n: int, *argv: str, **env: str) -> tuple[int, str, dict[int, dict]]:
    """The job, run once more where Open MPI crashed as it is known to
    (:func:`elastic_common.known_library_crash`)."""
    status, _, out, left = run_job_past_known_crash(
        str(tmp_path), n, [TRAIN_PROGRAM, "--steps", str(STEPS), *argv], OUTER_S,
        COMMLIB_TIMEOUT="60", **env)
    assert status != -9, f"hang (killed after {OUTER_S} s)\n{excerpt(out)}"
    assert not left, f"processes {left} of the job were left running\n{excerpt(out)}"
    assert not leftover_shm(str(tmp_path)), f"left {leftover_shm(str(tmp_path))} in /dev/shm"
    return status, out, results(str(tmp_path))


def check(found: dict[int, dict], trainers: list[int], reference: dict[int, dict],
          status: int, out: str, expected=KILLED, exact: bool = True) -> None:
    ok = expected.get(mpi_impl().key)
    assert ok is None or status in ok, f"status {status}\n{excerpt(out)}"
    assert sorted(found) == trainers, f"ranks {sorted(found)} finished, expected " \
                                      f"{trainers} (status {status})\n{excerpt(out)}"
    for rank, r in found.items():
        assert r["step"] == STEPS and r["size"] == 3, (rank, r["step"], r["size"])
        # every step applied exactly once, by a group of 3: the reference's ledger
        assert r["ledger"] == reference[0]["ledger"], (rank, r["ledger"])
        same = np.array_equal(params(r), params(reference[0]))
        if exact:
            mine, theirs = params(r), params(reference[0])
            assert same, (f"rank {rank}: parameters differ from the 3-rank reference in "
                          f"{int((mine != theirs).sum())} of {mine.size} entries, by up to "
                          f"{np.abs(mine - theirs).max():.3g}")
        else:
            assert not same, f"rank {rank}: equal to the reference"


def merges(r: dict) -> list[tuple[list[int], list[int]]]:
    """A rank's recoveries that merged spares: (members, spares joined)."""
    return [(x["members"], x["joined"]) for x in r["recoveries"] if x.get("joined")]


def test_a_spare_replaces_a_killed_trainer(tmp_path, reference):
    """3+1: trainer 2 SIGKILLed mid-backward at step 12; the survivors shrink, spare 3
    joins after them (group [0, 1, 3]), receives the state and trains: exact."""
    status, out, found = job(tmp_path, 4, "--fault", "kill", "--victims", "2", "--at", "12",
                             "--spares", "1")
    check(found, [0, 1, 3], reference, status, out)
    for rank, r in found.items():
        assert merges(r) == [([0, 1, 3], [3])], (rank, r["recoveries"])
    assert found[0]["recoveries"][0]["failed"] == [2], found[0]["recoveries"]


def test_a_spare_replaces_rank_0_the_other_is_released(tmp_path, reference):
    """3+2: rank 0 SIGKILLed; spare 3 joins (group [1, 2, 3]: rank 1 sends the state);
    spare 4 stands by to the end, is released and leaves (``run`` returns None there),
    having used little CPU while idle (no busy wait: a spinning wait would take a core's
    share; a sleeping process's share only falls under load)."""
    status, out, found = job(tmp_path, 5, "--fault", "kill", "--victims", "0", "--at", "12",
                             "--spares", "2")
    check(found, [1, 2, 3], reference, status, out)
    for rank, r in found.items():
        assert merges(r) == [([1, 2, 3], [3])], (rank, r["recoveries"])
    spare = results(str(tmp_path), "spare")
    assert sorted(spare) == [4] and spare[4]["step"] == 0, spare
    assert spare[4]["cpu_s"] < 0.25 * spare[4]["wall_s"], spare


def test_a_spare_dies_while_standing_by(tmp_path, reference):
    """3+2: spare 3 SIGKILLed while idle (once step 10 is committed): the trainers recover
    among themselves, still 3; then trainer 2 is killed at step 20: the dead spare is
    passed over and spare 4 joins ([0, 1, 4]). Exact; no spare is left to release."""
    status, out, found = job(tmp_path, 5, "--fault", "idlekill", "--victims", "3,2",
                             "--at", "10,20", "--spares", "2")
    check(found, [0, 1, 4], reference, status, out)
    for rank in (0, 1):
        recs = found[rank]["recoveries"]
        # (seen apart, the spare's death is a recovery of its own, members [0, 1, 2]; on a
        # loaded machine the trainers may run the 10 steps before they see it, and then
        # one recovery counts both deaths. Under Open MPI's ULFM, where the death of a
        # process no trainer talks to reaches the trainers through its runtime, once in
        # CI's load it came after trainer 2's recovery: then the merge's agreement alone
        # found spare 3 dead and passed it over, as below.)
        seen = any(3 in x.get("failed", ()) for x in recs)
        assert seen or mpi_impl().key == "openmpi", recs
        assert merges(found[rank]) == [([0, 1, 4], [4])], recs
    assert not results(str(tmp_path), "spare")


@pytest.mark.parametrize("point", ["called", "assembled", "receiving", "received"])
def test_a_spare_dies_while_it_joins(tmp_path, reference, point):
    """3+2: trainer 2 SIGKILLed at step 12; spare 3, called to replace it, SIGKILLs itself
    at a point of its joining (``--join-death``: the call received; the merged group
    built; the first tensor of the state received; the state applied). The survivors
    (with spare 3 where the merged group was built: it is a member and recovers with them)
    recover again without it and spare 4 joins: group [0, 1, 4], exact."""
    status, out, found = job(tmp_path, 5, "--fault", "kill", "--victims", "2", "--at", "12",
                             "--spares", "2", "--join-victim", "3", "--join-death", point)
    check(found, [0, 1, 4], reference, status, out)
    for rank in (0, 1):
        recs = found[rank]["recoveries"]
        assert merges(found[rank])[-1] == ([0, 1, 4], [4]), recs
        # (called: it died before the merged group was built, which the agreement left
        # it out of; later: a member, its death is a failure the group recovers from)
        assert point == "called" or any(3 in x.get("failed", ()) for x in recs), recs
    assert merges(found[4]) == [([0, 1, 4], [4])], found[4]["recoveries"]
    assert not results(str(tmp_path), "spare")


@pytest.mark.parametrize("victim", [0, 1])
def test_a_survivor_dies_while_a_spare_joins(tmp_path, reference, victim):
    """3+2: trainer 2 SIGKILLed at step 12; while spare 3 joins, survivor ``victim``
    SIGKILLs itself once the merged group [0, 1, 3] is built (``--join-death sending``;
    rank 0 is the one that sends spare 3 the state, rank 1 sends nothing). Spare 3 is a
    member of the merged group by then, with or without the state: it recovers with the
    other survivor (receiving the state from it if it had none) and trains, no longer
    standing by (before the fix it went back to standing by and the job hung); spare 4
    joins: group [1 - victim, 3, 4], exact."""
    status, out, found = job(tmp_path, 5, "--fault", "kill", "--victims", "2", "--at", "12",
                             "--spares", "2", "--join-victim", str(victim), "--join-death",
                             "sending")
    trainers = [1 - victim, 3, 4]
    check(found, trainers, reference, status, out)
    for rank in trainers:
        recs = found[rank]["recoveries"]
        assert merges(found[rank])[-1] == (trainers, [4]), recs
        # the survivor and spare 3 recovered from the victim's death together
        assert rank == 4 or any(victim in x.get("failed", ()) and
                                x["members"] == trainers[:2] for x in recs), recs
    assert not results(str(tmp_path), "spare")


def test_the_last_spare_dies_while_it_joins(tmp_path, tmp_path_factory):
    """3+1: trainer 2 SIGKILLed at step 12; the only spare dies with the state half
    received: the survivors go on at reduced strength ([0, 1]), exactly as the run in
    which rank 2 left after the agreed step."""
    from elastic_common import reference as shrunk_reference
    status, out, found = job(tmp_path, 4, "--fault", "kill", "--victims", "2", "--at", "12",
                             "--spares", "1", "--join-victim", "3", "--join-death",
                             "receiving")
    assert sorted(found) == [0, 1], f"{sorted(found)} finished ({status})\n{out[-3000:]}"
    agreed = found[0]["recoveries"][0]["step"]
    ref = shrunk_reference(tmp_path_factory, "gradient_allreduce", "2", str(agreed), n=3)
    for rank, r in found.items():
        assert r["step"] == STEPS and r["size"] == 2, (rank, r["step"], r["size"])
        assert r["ledger"] == ref[0]["ledger"], (rank, r["ledger"])
        assert np.array_equal(params(r), params(ref[0])), f"rank {rank} differs"
        assert any(3 in x.get("failed", ()) for x in r["recoveries"]), r["recoveries"]


def test_a_replacement_is_spawned_once_the_spares_are_used_up(tmp_path, reference):
    """3+1 with ``replace=True``: trainer 0 SIGKILLed at step 8 (spare 3 joins: [1, 2,
    3]), then trainer 1 at step 16: no spare is left, so the survivors [2, 3] spawn a
    replacement on rank 1's host and send it the state: back at 3, exact (every step
    applied by 3 ranks). The replacement writes its results as rank 0 (the smallest number
    no survivor has). This hung before in 3 of 4 runs: a spawn right after a death
    (``commlib.primitives.ft.SPAWN_SETTLE_S``)."""
    refusal = mpi_impl().spawn_refusal
    if refusal:
        pytest.skip(f"replacements refused: {refusal}")
    status, out, found = job(tmp_path, 4, "--fault", "kill", "--victims", "0,1", "--at",
                             "8,16", "--spares", "1", "--replace",
                             ELASTIC_HOSTS=rank_hosts(4))
    check(found, [0, 2, 3], reference, status, out)
    for rank in (2, 3):
        recs = found[rank]["recoveries"]
        assert merges(found[rank]) == [([1, 2, 3], [3])], recs
        assert [x["failed"] for x in recs if "failed" in x][-1] == [1], recs
    for rank in (0, 2, 3):  # (in the grown world, ranks 0..2: survivors 2, 3, the new one)
        grown = [x for x in found[rank]["recoveries"] if x.get("grown")]
        assert len(grown) == 1 and grown[0]["size"] == 3, found[rank]["recoveries"]


def test_the_pool_is_refilled_after_a_spare_joined(tmp_path, reference):
    """3+1 with ``refill=True``: trainer 2 SIGKILLed at step 8, spare 3 joins ([0, 1, 3]);
    at the next commit the trainers spawn a new spare, which builds its model and stands
    by (the pool back at 1); trainer 1 SIGKILLed at step 16: the new spare joins (no
    process start in the recovery), and the pool is refilled again; at the end the last
    spare is released. Back at 3 after each death, exact (every step applied by 3 ranks).
    Without the refill the second death would leave 2 trainers (``check`` sees it: every
    rank's size and ledger)."""
    refusal = mpi_impl().spawn_refusal
    if refusal:
        pytest.skip(f"spawning refused: {refusal}")
    status, out, found = job(tmp_path, 4, "--fault", "kill", "--victims", "2,1", "--at",
                             "8,16", "--spares", "1", "--refill",
                             ELASTIC_HOSTS=rank_hosts(4), COMMLIB_SHM="1")
    # (the first spawned spare, which joined, is named 1: the number no trainer has)
    check(found, [0, 1, 3], reference, status, out)
    for rank in (0, 3):
        recs = found[rank]["recoveries"]
        joined = [x for x in recs if x.get("joined")]
        # (ranks of the world then: the refill renumbered it, trainers first)
        assert len(joined) == 2 and [len(x["members"]) for x in joined] == [3, 3], recs
        assert not any(x.get("grown") for x in recs), recs  # no replacement was spawned
        # a refill after each joining (rank 3 took part in both as a trainer), 1 spawned
        assert [x["refilled"] for x in recs if "refilled" in x] == [1, 1], recs
    spare = results(str(tmp_path), "spare")
    assert len(spare) == 1 and all(s["step"] == 0 for s in spare.values()), spare


@pytest.mark.parametrize("second", ["replacement", "survivor", "replacement-remote"])
def test_a_death_after_a_replacement_joined(tmp_path, reference, second):
    """3 trainers with ``replace=True`` and no spare: trainer 2 SIGKILLed at step 8, a
    replacement is spawned on its host and takes the state; at step 16 a second SIGKILL
    mid-backward: of that replacement (``replacement``) or of rank 0, one of its parents
    and the spawn's root (``survivor``). The replacement lives in another
    ``MPI_COMM_WORLD`` (spawned), which neither the parents' launcher nor their watch of
    their own world's processes covers, nor the replacement's of theirs: the living must
    still see the death, recover, spawn another replacement and end back at 3, exact (every
    step applied by 3 ranks). Both hung until the watchdog (60 s) before the grown world's
    processes were watched (``failure_detection.Watcher.watch_grown``).

    ``replacement-remote``: the replacement's case with every process reporting a boot id
    of its own after ``init`` (``--other-machines``), so that the replacement and its
    parents look as if on other machines to each other: they watch each other by a TCP
    connection each (:mod:`commlib.fault.peer_sockets`), not by process id."""
    refusal = mpi_impl().spawn_refusal
    if refusal:
        pytest.skip(f"replacements refused: {refusal}")
    victims, extra = (("2,0", []) if second == "survivor"
                      else ("2", ["--replacement-dies-at", "16"]))
    if second == "replacement-remote":
        extra.append("--other-machines")
    status, out, found = job(tmp_path, 3, "--fault", "kill", "--victims", victims, "--at",
                             "8,16", "--replace", *extra, ELASTIC_HOSTS=rank_hosts(3))
    check(found, [0, 1, 2], reference, status, out)
    if second == "replacement-remote":  # rank 1, a parent throughout, watched each
        # replacement (rank 2 of each grown world) by connection, and only it
        assert found[1]["remote_watches"] == [[2], [2]], found[1]["remote_watches"]
    second = second.removesuffix("-remote")

    def seen(r: dict) -> tuple[list, int]:  # (failed world ranks, grown) per recovery
        return ([x["failed"] for x in r["recoveries"] if "failed" in x],
                sum(1 for x in r["recoveries"] if x.get("grown")))
    # rank 1 survives throughout: two deaths, two replacements (ranks of the world then:
    # the second death is rank 2 of the grown world, the replacement, or its rank 0)
    assert seen(found[1]) == ([[2], [2 if second == "replacement" else 0]], 2), \
        found[1]["recoveries"]
    if second == "survivor":  # the first replacement (named 0) saw the second death
        assert seen(found[0]) == ([[0]], 2), found[0]["recoveries"]  # (its own join too)
    else:  # rank 0 survives throughout too
        assert seen(found[0]) == seen(found[1]), found[0]["recoveries"]
        with open(tmp_path / "fault2.json") as f:  # written by the dead replacement
            assert json.load(f)["step"] == 16


# (a replacement dying once it took the state is test_a_death_after_a_replacement_joined's
# case but earlier: measured passing on MPICH, left out of CI for time)
@pytest.mark.parametrize("point", ["replacement-assembled", "survivor-sending"])
def test_a_death_while_a_replacement_joins(tmp_path, reference, point):
    """3 trainers with ``replace=True`` and no spare: trainer 2 SIGKILLed at step 8, a
    replacement is spawned; then a second SIGKILL during its joining: of the replacement
    itself, once the grown world is built (before the state is sent: ``assembled``), or of
    survivor 1 about to send the state
    (``survivor-sending``: the replacement, without state, then recovers with rank 0 and
    takes the agreed commit as a member without state). Every time the living recover,
    spawn a replacement again and end back at 3, exact (every step applied by 3 ranks)."""
    refusal = mpi_impl().spawn_refusal
    if refusal:
        pytest.skip(f"replacements refused: {refusal}")
    who, where = point.split("-")
    if who == "replacement" and mpi_impl().respawn_bug:
        pytest.skip(f"known bug: {mpi_impl().respawn_bug}")
    extra = (["--replacement-join-death", where] if who == "replacement"
             else ["--join-victim", "1", "--join-death", where])
    status, out, found = job(tmp_path, 3, "--fault", "kill", "--victims", "2", "--at", "8",
                             "--replace", *extra, ELASTIC_HOSTS=rank_hosts(3))
    check(found, [0, 1, 2], reference, status, out)
    grown = [x for x in found[0]["recoveries"] if x.get("grown")]
    failed = [x["failed"] for x in found[0]["recoveries"] if "failed" in x]
    # rank 0 survives throughout: both deaths seen (a joining interrupted on rank 0 has
    # no record of its own: whether rank 0's broadcast of the state ended first is timing)
    assert failed == [[2], [2] if who == "replacement" else [1]], found[0]["recoveries"]
    assert 1 <= len(grown) <= 2 and grown[-1]["size"] == 3, found[0]["recoveries"]
    if point == "survivor-sending":  # the replacement took part without state
        assert any(x.get("failed") == [1] and [-1, False] in x["values"].values()
                   for x in found[0]["recoveries"]), found[0]["recoveries"]


@requires_store_world
@pytest.mark.parametrize("victim", [2, 0], ids=["trainer", "store-host"])
def test_a_spare_replaces_a_killed_trainer_in_the_store_backed_world(tmp_path, reference,
                                                                     victim):
    """3+1 started as a Kubernetes job would (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``;
    rank 0 hosts the store, ``commlib.mpi.launch``): trainer 2 SIGKILLed at step 12, spare
    3 joins ([0, 1, 3]), exact against the same 3-rank reference (the store-backed world's
    4-rank MPICH layout adds the same pairs, see test_elastic_store). ``store-host``: rank
    0, the store's host, is the one killed: rank 1's standby store takes over
    (commlib.mpi.launch.standby) and spare 3 joins [1, 2, 3]."""
    codes, _, out, left = run_store_job(4, [TRAIN_PROGRAM, str(tmp_path), "--steps",
                                            str(STEPS), "--fault", "kill", "--victims",
                                            str(victim), "--at", "12", "--spares", "1"],
                                        OUTER_S, COMMLIB_TIMEOUT="60",
                                        COMMLIB_FAULT_TOLERANT="1")
    assert codes == [-9 if r == victim else 0 for r in range(4)] and not left, \
        (codes, out[-3000:])
    assert not leftover_shm(str(tmp_path)), leftover_shm(str(tmp_path))
    found = results(str(tmp_path))
    members = [r for r in range(4) if r != victim]
    check(found, members, reference, 0, out, expected={})
    for rank, r in found.items():
        assert merges(r) == [(members, [3])], (rank, r["recoveries"])
    assert out.count("standby store is the store now") == (3 if victim == 0 else 0), \
        out[-3000:]


def test_the_check_sees_a_spare_without_the_state(tmp_path, reference):
    """Negative control: the joining spare keeps its own (initial) model: every trainer
    ends away from the reference (the spare's gradients are those of another model)."""
    status, out, found = job(tmp_path, 4, "--fault", "kill", "--victims", "2", "--at", "12",
                             "--spares", "1", "--skip-spare-state")
    check(found, [0, 1, 3], reference, status, out, exact=False)


def test_spares_must_leave_a_trainer(tmp_path):
    """``spares`` >= the world size: ValueError on every rank that gets there, naming the
    argument and the rank; nothing trains. (Every rank raises it; under load Open MPI's
    launcher once ended rank 0, still starting, as soon as rank 1 had left with status 1,
    before rank 0 printed anything: so at least one rank's message, and no other error.)"""
    status, out, found = job(tmp_path, 2, "--spares", "2")
    assert status != 0 and not found, (status, out[-2000:])
    said = out.count("argument 'spares'=2 must be >= 0 and smaller than the world size 2")
    expected = 2 if mpi_impl().key == "mpich" else (1, 2)
    assert said == expected if isinstance(expected, int) else said in expected, out[-3000:]
    assert out.count("Traceback") == said, out[-3000:]

