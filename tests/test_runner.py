"""``python -m commlib``: an unmodified torch DDP script on commlib.

* pytorch/examples' minGPT-ddp (``tests/mingpt``: CPU edits only, no commlib line) trains
  under ``mpiexec -n 2`` and ``-n 3`` with each of ``gradient_allreduce``, ``bytegrad``,
  ``local_sgd`` and ``decentralized``: at every sync point (each epoch's end, which precedes
  the epoch's snapshot, and the end of training) every rank reports its replica's checksum
  and all are equal; the snapshot left on disk holds that replica; the loss falls.
  Negative control: ``local_sgd`` with ``--no-sync-points`` ends with replicas that differ
  (and a snapshot that holds rank 0's).
* The command line: ``sys.argv``, ``__name__``, ``sys.path[0]``, torch's DDP names, the
  algorithm and its configuration, the backend of ``init_process_group()``, exit statuses
  and exceptions passed through, bad options refused with status 2.
"""
import json
import os
import re
import socket
import subprocess
import sys

import pytest

from helpers import clean_env, run_mpi, serial_only

torch = pytest.importorskip("torch")
HERE = os.path.dirname(os.path.abspath(__file__))
MINGPT = os.path.join(HERE, "mingpt", "main.py")
PROBE = os.path.join(HERE, "runner_probe.py")
pytestmark = serial_only

SYNC = re.compile(r"commlib\.run: rank (\d+): sync point (\d+) \(([^)]*)\)( \(sync points off\))?:"
                  r" (\w+)\[(\w+)\]( averaged)? sha256=([0-9a-f]{16})")
LOSS = re.compile(r"\[RANK(\d+)\] Epoch (\d+) \| Iter 0 \| (Train|Eval) Loss ([0-9.]+)")
CONFIG = {"local_sgd": {"sync_every": 5}}  # 12 (2 ranks) and 8 (3 ranks) steps per epoch
EPOCHS = 2
DESTROY = "end of training: destroy_process_group"


def tail(code, out):
    return f"exit status {code}; output ends with:\n{out[-4000:]}"


def sync_points(out, n):
    """{sync point number: (reason, {rank: checksum}, averaged on some rank)}"""
    points = {}
    for rank, k, reason, _, _, _, averaged, sha in SYNC.findall(out):
        entry = points.setdefault(int(k), (reason, {}, []))
        entry[1][int(rank)] = sha
        entry[2].append(bool(averaged))
    for k, (reason, shas, _) in points.items():
        assert sorted(shas) == list(range(n)), f"sync point {k} ({reason}): ranks {sorted(shas)}"
    return {k: (r, shas, any(a)) for k, (r, shas, a) in points.items()}


def assert_identical(points):
    """Every rank's replica has the same checksum at every sync point."""
    for k, (reason, shas, _) in sorted(points.items()):
        assert len(set(shas.values())) == 1, f"sync point {k} ({reason}): replicas {shas}"


def snapshot_checksum(path):
    from commlib.run.sync import checksum
    state = torch.load(path, map_location="cpu")["model_state"]
    module = torch.nn.Module()
    module.state_dict = lambda: state  # checksum() reads state_dict()
    return checksum(module)


def mingpt(n, algorithm, tmp_path, *options):
    snapshot = tmp_path / f"{algorithm}-{n}.pt"
    args = ["-m", "commlib", "--verbose", "--algorithm", algorithm]
    if algorithm in CONFIG:
        args += ["--algorithm-config", json.dumps(CONFIG[algorithm])]
    args += [*options, MINGPT, f"trainer_config.snapshot_path={snapshot}",
             f"trainer_config.max_epochs={EPOCHS}"]
    code, _, out = run_mpi(n, args, timeout=400, OMP_NUM_THREADS="1")
    assert code == 0, tail(code, out)
    return out, snapshot


@pytest.mark.parametrize("n", [3])  # 2 ranks run the same code (CI time)
def test_mingpt_every_algorithm_identical_replicas(tmp_path, n):
    for algorithm in ["gradient_allreduce", "bytegrad", "local_sgd", "decentralized"]:
        out, snapshot = mingpt(n, algorithm, tmp_path)
        where = f"{algorithm} at {n} ranks"
        points = sync_points(out, n)
        reasons = [points[k][0] for k in sorted(points)]
        # Per epoch: the end of the training loader, then of the evaluation loader; then
        # destroy_process_group() (the script's wrapper is gone at its end).
        assert reasons == ["epoch end"] * (2 * EPOCHS) + [DESTROY], (where, reasons)
        assert_identical(points)
        relaxed = algorithm in ("local_sgd", "decentralized")
        averaged = [points[k][2] for k in sorted(points)]
        assert averaged == ([True, False] * EPOCHS if relaxed else [False] * (2 * EPOCHS)) \
            + [False], (where, averaged)
        assert out.count("Snapshot saved at epoch") == EPOCHS, (where, tail(0, out))
        end = points[max(points)][1][0]
        assert snapshot_checksum(snapshot) == end, where
        print(f"CHECKSUMS minGPT {where}: every sync point's replicas "
              f"{[sorted(set(points[k][1].values())) for k in sorted(points)]}, snapshot {end}")
        losses = {(int(r), int(e), kind): float(v) for r, e, kind, v in LOSS.findall(out)}
        for rank in range(n):
            for kind in ("Train", "Eval"):
                first, last = losses[(rank, 1, kind)], losses[(rank, EPOCHS, kind)]
                assert last < first - 0.2, (where, rank, kind, first, last)


def test_mingpt_without_sync_points_replicas_differ(tmp_path):
    """Negative control: local_sgd's replicas apart at the end without the sync points (so
    the check above can fail), the snapshot holding rank 0's replica."""
    out, snapshot = mingpt(2, "local_sgd", tmp_path, "--no-sync-points")
    points = sync_points(out, 2)
    assert not any(averaged for _, _, averaged in points.values())
    with pytest.raises(AssertionError, match="replicas"):
        assert_identical(points)
    end = points[max(points)][1]
    assert end[0] != end[1], end
    assert snapshot_checksum(snapshot) == end[0]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def runner(args, cwd=None, **env):
    """``python -m commlib ARGS`` as a singleton (a world of one)."""
    extra = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(free_port()), **env}
    env = clean_env(**extra)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "commlib", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd, env=env)
    out = proc.stdout + proc.stderr
    found = re.findall(r"PROBE (\{.*\})", out)
    return proc.returncode, out, json.loads(found[0]) if found else None


def test_command_line_script_and_exit_status(tmp_path):
    code, out, seen = runner(["--algorithm", "local_sgd", "--algorithm-config",
                              '{"sync_every": 3}', "--backend", "gloo", PROBE, "a", "--b=1",
                              "-m", "x"], cwd=str(tmp_path), PROBE_EXIT="7")
    assert code == 7, tail(code, out)
    assert seen["argv"] == [PROBE, "a", "--b=1", "-m", "x"]
    assert seen["name"] == "__main__" and seen["path0"] == HERE
    assert seen["ddp"] == "commlib.run.patch.DistributedDataParallel" and seen["same_class"]
    assert seen["is_torch_ddp"]
    assert seen["algorithm"] == "local_sgd" and "sync_every=3" in seen["algorithm_repr"], seen
    assert seen["explicit"] == "gradient_allreduce"
    assert seen["backend"] == "ProcessGroupGloo" and seen["default_backend"] == "gloo"
    assert seen["pickled"] == 5
    assert seen["accelerate_use_cpu"] is None  # a world of one: Accelerate left alone


def test_command_line_module_exception_and_environment(tmp_path):
    code, out, seen = runner(["-m", "runner_probe"], cwd=HERE, PROBE_RAISE="probe failed",
                             COMMLIB_ALGORITHM="decentralized")
    assert code == 1, tail(code, out)
    assert "RuntimeError: probe failed" in out and "Traceback" in out
    assert seen["algorithm"] == "decentralized" and seen["backend"] == "ProcessGroupCommlib"
    assert seen["default_backend"] == "commlib" and seen["name"] == "__main__"
    assert seen["argv"][0].endswith("runner_probe.py")


@pytest.mark.parametrize("args, message", [
    (["--algorithm", "nope", PROBE], "unknown algorithm 'nope'"),
    (["--algorithm", "local_sgd", "--algorithm-config", '{"bad": 1}', PROBE], "['bad']"),
    (["--algorithm-config", "[1]", PROBE], "expected a JSON object"),
    (["--backend", "nccl", PROBE], "expected one of commlib, gloo"),
    (["--bogus", PROBE], "unknown option '--bogus'"),
    (["missing.py"], "can't open file 'missing.py'"),
    ([], "no script given"),
])
def test_command_line_errors(args, message):
    import contextlib
    import io

    from commlib.run import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(args) == 2
    assert message in err.getvalue() and "usage: python -m commlib" in err.getvalue()


END_PROGRAM = os.path.join(HERE, "runner_end_program.py")


def test_end_of_script_sync_point():
    """A clean end averages local_sgd's replicas before atexit handlers see them (7 steps,
    synchronized every 5); a non-zero exit (the negative control) averages nothing, and its
    status is the job's."""
    args = ["-m", "commlib", "--algorithm", "local_sgd", "--algorithm-config",
            '{"sync_every": 5}', END_PROGRAM]
    for status in (0, 3):
        code, _, out = run_mpi(2, args, timeout=300, END_EXIT=str(status))
        assert code == status, tail(code, out)
        ends = dict(re.findall(r"END rank (\d+) ([0-9a-f]{16})", out))
        assert sorted(ends) == ["0", "1"], tail(code, out)
        assert (ends["0"] == ends["1"]) == (status == 0), (status, ends)


def test_engine_keeps_no_finished_job_alive():
    """A wrapper the script dropped must be collectable (the end-of-script sync point only
    averages wrappers still alive): the communication thread, idle, holds no reference to
    its last job (a closure over the wrapper)."""
    import gc
    import time
    import weakref

    from commlib.ddp.engine import Engine

    class Owner:
        pass

    engine = Engine(threaded=True)
    try:
        owner = Owner()
        # a closure over owner, run before the del below (F821 sees only the del)
        engine.submit(lambda: owner).result()  # noqa: F821
        ref = weakref.ref(owner)
        del owner
        for _ in range(200):  # the thread returns from the job just after resolving it
            gc.collect()
            if ref() is None:
                break
            time.sleep(0.01)
        assert ref() is None, "the communication thread keeps its last job alive"
    finally:
        engine.close()
