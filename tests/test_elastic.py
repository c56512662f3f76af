"""Elastic training survives dead ranks exactly (issue 21 sections 2-4): jobs of
``elastic_train_program.py`` (float64 MLP, SGD with momentum, ``commlib.elastic``) under
real failures, each under an outer timeout, compared bit for bit with a reference run.

For each fault the survivors must finish every step; their final parameters must equal
exactly those of the *reference*: a run without fault tolerance and without failures in
which the same ranks leave voluntarily after the steps the survivors agreed on, and the
others go on over a group of the remaining ranks (float64 and the same MPI layout, so the
check is exact: a difference of one step in where the shrink happens changes hundreds of
parameters, see ``test_the_check_tells_one_step_apart``). The state's ledger (which group
size applied each step, carried with the state) must list every step exactly once; nothing
may hang, no process may be left, no shared-memory segment may stay in ``/dev/shm``.

Faults (4 ranks on the MPI implementation under test, each rank a failure domain of its own
and the launcher keeping the others running: one hydra proxy per rank and
``-disable-auto-cleanup`` on MPICH, ``--with-ft ulfm`` on Open MPI, see
``elastic_common.per_rank_hosts``): ``os._exit`` of one
rank mid-backward (with ``scale_lr``); two successive SIGKILLs; a SIGKILL mid-forward and
one inside ``State.commit``; ``lag``: the survivors are
made one step apart (one applies the step, one does not), so that the rank behind must
receive the state from one ahead (``lagavg``: the same with ``local_sgd``'s average, where
it keeps its own optimizer state); SIGKILL mid-backward under ``decentralized`` (replicas
differ; every survivor restores its own copy of the earliest commit) and ``local_sgd``
(the partial round is discarded); on the emulated two-tier cluster
(``benchmarks/netsim.py``, one proxy per node): SIGKILL of one rank of 2 nodes x 2 (hydra
then ends its node: a node failure) and of one rank of 4 x 1; a replacement joins after a
SIGKILL and the grown job equals the run without failure. ``run(min_ranks=)`` ends the job
when too few survive. Negative controls: a recovery that skips the step agreement does not
finish (3 ranks); without fault tolerance the same kill ends the job
(``test_elastic_ft.py``, the same launch and fault under collectives alone).

Cost: a job is mostly startup (4 processes importing torch and building an optimizer, about
10 s of CPU), so the references the tests need are trained one after the other in one job
(``PLANNED``); a survivors' agreement outside it gets a reference job of its own.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from elastic_common import (
    HERE,
    ROOT,
    cluster_refusal,
    fault_tolerant_launch,  # noqa: F401 - skips where refused
    leftover_shm,
    params,
    rank_hosts,
    reference,
    reference_args,
    results,
    run_cluster_job,
    run_job,
)
from helpers import mpi_impl, serial_only

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import netsim  # noqa: E402

PROGRAM = os.path.join(HERE, "elastic_train_program.py")
N = 4
STEPS = 30
OUTER_S = 150
pytestmark = [serial_only, pytest.mark.timeout(900),
              pytest.mark.usefixtures("fault_tolerant_launch")]
def check(tmp_path, tmp_path_factory, survivors: list[int], recoveries: int, status: int,
          out: str, left: list[int], algorithm: str = "gradient_allreduce",
          scale_lr: bool = False, cluster=None) -> dict[int, dict]:
    assert status != -9, f"hang (killed after {OUTER_S} s)\n{out[-3000:]}"
    assert not left, f"processes {left} of the job were left running"
    assert not leftover_shm(str(tmp_path)), f"left {leftover_shm(str(tmp_path))} in /dev/shm"
    found = results(str(tmp_path))
    assert sorted(found) == survivors, f"ranks {sorted(found)} finished, expected " \
                                       f"{survivors} (status {status})\n{out[-3000:]}"
    first = found[survivors[0]]
    for rank, r in found.items():
        assert r["step"] == STEPS, f"rank {rank} stopped at step {r['step']}"
        assert len(r["recoveries"]) == recoveries, (rank, r["recoveries"])
        assert r["recoveries"] == first["recoveries"] or \
            [x["values"] for x in r["recoveries"]] == [x["values"] for x in first["recoveries"]]
        # Every step applied exactly once, by the group the recoveries say.
        assert [s for s, _ in r["ledger"]] == list(range(1, STEPS + 1)), r["ledger"]
        sizes, size = [], N
        marks = {x["step"]: x["size"] for x in r["recoveries"]}
        for s in range(STEPS):
            size = marks.get(s, size)
            sizes.append(size)
        assert [n for _, n in r["ledger"]] == sizes, (rank, r["ledger"], marks)
    victims, steps = reference_args(found)
    ref = reference(tmp_path_factory, algorithm, victims, steps, scale_lr, cluster)
    for rank in survivors:
        mine, theirs = params(found[rank]), params(ref[rank])
        assert np.array_equal(mine, theirs), (
            f"rank {rank}: parameters differ from the reference that shrinks at steps "
            f"{steps} (victims {victims}) in {int((mine != theirs).sum())} of {mine.size} "
            f"entries, by up to {np.abs(mine - theirs).max():.3g}")
        assert found[rank]["ledger"] == ref[rank]["ledger"]
        assert found[rank]["lr"] == ref[rank]["lr"]
    return found


def ft_job(tmp_path, *argv: str, timeout: str = "60",
           n: int = N) -> tuple[int, float, str, list[int]]:
    return run_job(n, [PROGRAM, str(tmp_path), "--steps", str(STEPS), *argv], OUTER_S,
                   COMMLIB_TIMEOUT=timeout)


def test_one_rank_exits_lr_rescaled(tmp_path, tmp_path_factory):
    """``os._exit`` mid-backward (SIGKILL mid-backward: the two-tier, decentralized,
    local_sgd, replacement and store tests); ``scale_lr``: the learning rate becomes 3/4 of
    itself at the shrink, as in the reference."""
    status, _, out, left = ft_job(tmp_path, "--fault", "exit", "--scale-lr")
    found = check(tmp_path, tmp_path_factory, [0, 1, 2], 1, status, out, left, scale_lr=True)
    assert found[0]["lr"] == 0.05 * 3 / 4, found[0]["lr"]


def test_two_successive_failures(tmp_path, tmp_path_factory):
    status, _, out, left = ft_job(tmp_path, "--fault", "kill", "--victims", "3,2",
                                  "--at", "8,16")
    check(tmp_path, tmp_path_factory, [0, 1], 2, status, out, left)


@pytest.mark.parametrize("fault", ["killfwd", "killcommit"])
def test_killed_mid_forward_or_inside_the_commit(tmp_path, tmp_path_factory, fault):
    """Rank 3 SIGKILLed in the middle of step 12's forward (nothing of the step exchanged:
    the survivors agree on 12) or inside its commit (its optimizer step applied and counted,
    the commit not recorded; the survivors commit 13 where their exchange completed, 12
    where it was given up on, and agree on the most advanced): exact against the run that
    shrinks at the agreed step."""
    status, _, out, left = ft_job(tmp_path, "--fault", fault)
    found = check(tmp_path, tmp_path_factory, [0, 1, 2], 1, status, out, left)
    agreed = found[0]["recoveries"][0]["step"]
    assert agreed in ((12,) if fault == "killfwd" else (12, 13)), found[0]["recoveries"]


def test_survivors_one_step_apart(tmp_path, tmp_path_factory):
    """Rank 1 misses step 13 that ranks 0 and 2 applied: the agreement takes step 13 (the
    most advanced commit) and rank 1 receives the state from rank 0. (Whether a survivor's
    exchange of step 13 completed when the victim died after its own depends on the
    library's allreduce: Intel MPI's left rank 0 at step 12 too, and both received the
    state from rank 2: the check is that rank 1 is behind and some survivor ahead.)"""
    status, _, out, left = ft_job(tmp_path, "--fault", "lag")
    found = check(tmp_path, tmp_path_factory, [0, 1, 2], 1, status, out, left)
    values = found[0]["recoveries"][0]["values"]
    # rank 1 behind, some survivor ahead: the state travels (MPICH: 13, 12, 13)
    assert values["1"] == [12, True] and [13, True] in values.values(), values
    assert all(v in ([12, True], [13, True]) for v in values.values()), values


def test_local_sgd_survivor_one_average_behind(tmp_path, tmp_path_factory):
    """``local_sgd``: rank 1 takes part in the average of step 12 but misses applying it
    (as a wait given up on just after the data came: under ULFM a survivor's revoke ends
    such a wait, seen once in 5 bench runs on Open MPI at load 9-12); the others apply it.
    Rank 1 receives the averaged model and keeps its own optimizer state (momentum is
    never averaged): exactly the reference. Before the fix it took rank 0's momentum and
    every survivor ended 1732 of 1732 parameters away from the reference."""
    status, _, out, left = ft_job(tmp_path, "--fault", "lagavg", "--algorithm", "local_sgd")
    found = check(tmp_path, tmp_path_factory, [0, 1, 2], 1, status, out, left, "local_sgd")
    values = found[0]["recoveries"][0]["values"]
    assert values == {"0": [12, True], "1": [8, True], "2": [12, True]}, values


def test_skipping_the_step_agreement_goes_wrong(tmp_path):
    """Negative control (3 ranks: no reference needed): the same failure, each survivor
    going on from its own commit: rank 1 stays a step behind rank 0, their collectives no
    longer match, and the job does not finish (the watchdog ends it). The launcher's end of
    the job after the watchdog's MPI_Abort takes a while: under ULFM the other survivor
    counted the aborting rank dead and once finished alone (at 1 rank, a second shrink)
    before it was killed; no survivor finishes over the first shrink's group."""
    status, _, out, left = ft_job(tmp_path, "--fault", "lag", "--victims", "2",
                                  "--skip-agreement", timeout="6", n=3)
    assert status != -9 and not left, (status, out[-2000:])
    # (the job's status is the watchdog's 70, or now and then on MPICH the victim's
    # SIGKILL, 9, when hydra reports that rank's end first: seen once in CI; the watchdog
    # must have ended it either way)
    assert status in (70, 9) and "did not complete within 6 s" in out, (status, out[-2000:])
    for rank, r in results(str(tmp_path)).items():
        assert len(r["recoveries"]) > 1 and r["size"] == 1, (rank, r["recoveries"])


# A rare flake of issue 21's closing note (once in ~20 runs a survivor did not finish). Its
# cause, found on 2026-12-02: the victim died in the middle of a large message to rank 0,
# whose UCX cma copy out of the dead process failed and ended rank 0 ("process_vm_readv
# ... No such process"). Fault-tolerant mode now turns UCX's rendezvous inside a machine off
# (commlib.mpi.ucx_env, tests/test_ucx_env.py); the rerun stays until more full runs back the fix.
@pytest.mark.flaky(reruns=1)
@pytest.mark.parametrize("algorithm", ["decentralized", "local_sgd", "diloco",
                                       "streaming_diloco", "powersgd",
                                       "low_precision_decentralized", "qadam",
                                       "sparseloco", "muloco", "demo"])
def test_other_algorithms(tmp_path, tmp_path_factory, algorithm):
    synced = algorithm in ("local_sgd", "diloco")
    at = "14" if synced else "12"  # mid-round: the round is discarded
    status, _, out, left = ft_job(tmp_path, "--fault", "kill", "--algorithm", algorithm,
                                  "--at", at)
    found = check(tmp_path, tmp_path_factory, [0, 1, 2], 1, status, out, left, algorithm)
    if synced:  # the last average (outer step), before step 14
        assert found[0]["recoveries"][0]["step"] == 12
    if algorithm in ("sparseloco", "muloco"):
        # no exchange until step 16's outer step: the survivors learn of the death at a
        # commit's fence, the earliest of their last commits is agreed (MPICH: 13 or 12,
        # both seen), and inner steps after the outer step of 12 are kept (at 13), not
        # discarded as diloco's
        rec = found[0]["recoveries"][0]
        assert rec["step"] in (12, 13, 14, 15), rec
        assert rec["step"] == min(v[0] for v in rec["values"].values()), rec
    if algorithm == "low_precision_decentralized":  # neighbour copies rebuilt for 3 ranks
        assert all(r["ring"] for r in found.values()), {k: r["ring"] for k, r in found.items()}


@pytest.mark.parametrize("algorithm", ["sparseloco", "muloco", "demo"])
def test_forgetting_the_error_feedback_goes_wrong(tmp_path, tmp_path_factory, algorithm):
    """Negative control of the per-rank error feedback: the same SIGKILL, each survivor
    restarting its error feedback (``demo``: its momentum) from zero after the recovery
    instead of restoring its own (``--forget-own-state``): the job finishes, but the
    survivors' parameters leave the reference's."""
    status, _, out, left = ft_job(tmp_path, "--fault", "kill", "--algorithm", algorithm,
                                  "--at", "12", "--forget-own-state")
    assert status != -9 and not left, (status, out[-2000:])
    found = results(str(tmp_path))
    assert sorted(found) == [0, 1, 2], (sorted(found), status, out[-3000:])
    victims, steps = reference_args(found)
    ref = reference(tmp_path_factory, algorithm, victims, steps)
    for rank in found:
        mine, theirs = params(found[rank]), params(ref[rank])
        assert not np.array_equal(mine, theirs), rank
        print(f"{algorithm} rank {rank}: {int((mine != theirs).sum())} of {mine.size} "
              f"parameters differ, by up to {np.abs(mine - theirs).max():.3g}")


def test_the_check_tells_one_step_apart(tmp_path_factory):
    """The exact comparison can fail: references shrinking one step apart differ."""
    a = reference(tmp_path_factory, "gradient_allreduce", "3", "12")
    b = reference(tmp_path_factory, "gradient_allreduce", "3", "13")
    assert not np.array_equal(params(a[0]), params(b[0]))


def test_the_check_tells_a_kept_partial_round(tmp_path_factory):
    """``diloco``: the survivors of a death at step 14 go on from the outer step of step 12
    (the partial round discarded); a reference that kept the inner steps 13 and 14 (shrunk
    at 14, as a per-rank commit would) differs."""
    a = reference(tmp_path_factory, "diloco", "3", "12")
    b = reference(tmp_path_factory, "diloco", "3", "14")
    assert not np.array_equal(params(a[0]), params(b[0]))


def test_fewer_survivors_than_min_ranks_end_the_job(tmp_path):
    """``run(min_ranks=3)`` at 3 ranks: after the kill 2 survive; each raises CommError,
    the job ends (no survivor finishes, nothing hangs or is left)."""
    status, _, out, left = ft_job(tmp_path, "--fault", "kill", "--victims", "2",
                                  "--min-ranks", "3", n=3)
    assert status not in (0, -9) and not left, (status, out[-2000:])
    assert not results(str(tmp_path)), out[-2000:]
    assert "2 rank(s) survive, fewer than min_ranks=3" in out, out[-2000:]
    assert not leftover_shm(str(tmp_path))


OK, WHY = netsim.can_build_cluster()


@pytest.fixture
def on_the_cluster() -> None:
    why = cluster_refusal()
    if why:
        pytest.skip(why)


@pytest.mark.skipif(not OK, reason=WHY)
@pytest.mark.usefixtures("on_the_cluster")
@pytest.mark.parametrize("layout", [(2, 2), (4, 1)])
def test_two_tier_cluster(tmp_path, tmp_path_factory, layout):
    """SIGKILL of rank 3: on 2 x 2 hydra usually ends its node (rank 2 too; when it does
    not, rank 2 survives as on 4 x 1), on 4 x 1 it dies alone; the survivors finish, exactly as the reference. The reference is the per-rank
    launch's (measured bitwise equal to the same reference run on the cluster: 4 x 1 has
    its layout, one rank per node; on 2 x 2 MPICH's 4-rank allreduce adds the same pairs,
    (0+1)+(2+3), and 2 ranks add in either order alike), so no reference job runs here."""
    nodes, per_node = layout
    with netsim.two_tier(nodes=nodes, ranks_per_node=per_node, rate_mbit=None) as cluster:
        argv = [PROGRAM, str(tmp_path), "--steps", str(STEPS), "--fault", "kill"]
        status, _, out, left = run_cluster_job(cluster, argv, OUTER_S, COMMLIB_TIMEOUT="60")
    found = results(str(tmp_path))
    survivors = [0, 1, 2]
    if per_node == 2 and sorted(found) != survivors:
        # Usually the node's proxy ends rank 2 with its node; once in CI (1 run of many)
        # it did not, and rank 2 went on as a survivor: commlib's outcome is exact either
        # way, which the check below verifies for whichever ranks survived.
        survivors = [0, 1]
    recoveries = len(next(iter(found.values()))["recoveries"]) if found else 1
    check(tmp_path, tmp_path_factory, survivors, recoveries, status, out, left)


# A known rare flake, open in issue 21's closing note (once in 6 full runs the grown job did
# not end after training); one rerun, which the report shows as RERUN.
@pytest.mark.flaky(reruns=1)
def test_a_replacement_joins(tmp_path, tmp_path_factory):
    """Section 4: after the kill the survivors spawn a replacement (``MPI_Comm_spawn`` on
    the dead rank's host), send it the state by broadcast, and the four go on: exactly the
    run in which nobody died."""
    status, _, out, left = run_job(N, [PROGRAM, str(tmp_path), "--steps", str(STEPS),
                                       "--fault", "kill", "--replace"], OUTER_S,
                                   COMMLIB_TIMEOUT="60", ELASTIC_HOSTS=rank_hosts(N))
    assert status != -9 and not left, (status, out[-3000:])
    assert not leftover_shm(str(tmp_path))
    refusal = mpi_impl().spawn_refusal
    if refusal:  # refused on every survivor, by name, before MPI_Comm_spawn is called
        assert status != 0 and not results(str(tmp_path)), (status, out[-3000:])
        assert out.count(f"no replacement can be spawned on {mpi_impl().describe()}") == 3, \
            out[-3000:]
        pytest.skip(f"replacements refused (checked): {refusal}")
    found = results(str(tmp_path))
    assert sorted(found) == [0, 1, 2, 3], f"{sorted(found)} finished\n{out[-3000:]}"
    for rank, r in found.items():
        assert r["step"] == STEPS and r["size"] == N, (rank, r["step"], r["size"])
        grown = [x for x in r["recoveries"] if x.get("grown")]
        assert len(grown) == 1 and grown[0]["size"] == N, r["recoveries"]
        assert [s for s, _ in r["ledger"]] == list(range(1, STEPS + 1))
        assert all(n == N for _, n in r["ledger"]), r["ledger"]
    ref = reference(tmp_path_factory, "gradient_allreduce", "", "")  # nobody dies
    for rank in range(N):
        assert np.array_equal(params(found[rank]), params(ref[rank])), \
            f"rank {rank} (the replacement: {rank == N - 1}) differs from the run without failure"
