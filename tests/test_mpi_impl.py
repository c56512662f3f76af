"""commlib.mpi.mpi_impl: each implementation recognised from its own version text (as the
wheels print it), its launcher options, and the shared-memory rule of commlib.mpi.shm under the
implementation being tested (every rank's segments lose their names once the node mapped
them)."""
import os

import pytest

from commlib.mpi.mpi_impl import Implementation, current, identify

TEXTS = {
    "mpich": "MPICH Version:      5.0.2\nMPICH Release date: Mon Jun  2 2026\nMPICH ABI: 17:2:5",
    "openmpi": "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: "
               "5.0.11, repo rev: v5.0.11rc1, Sep 16, 2026",
    "intel": "Intel(R) MPI Library 2021.18.1 for Linux* OS\n",
}


@pytest.mark.parametrize("key,version", [("mpich", "5.0.2"), ("openmpi", "5.0.11"),
                                         ("intel", "2021.18.1")])
def test_identify(key, version):
    impl = identify(TEXTS[key])
    assert (impl.key, impl.version) == (key, version)
    assert impl.abi == ("openmpi" if key == "openmpi" else "mpich")
    assert impl.store_world == (key != "openmpi")


def test_unknown_library_gets_no_workarounds():
    impl = identify("Some MPI 1.0")
    assert impl.key == "unknown" and impl.shm_prefixes == () and not impl.store_world
    assert impl.name == "Some MPI 1.0"
    with pytest.raises(ValueError, match="fault-tolerant mode is not available"):
        impl.launch_args(2, fault_tolerant=True)


def test_launch_args():
    ompi, mpich = identify(TEXTS["openmpi"]), identify(TEXTS["mpich"])
    assert ompi.launch_args(4, oversubscribe=True) == ["--oversubscribe", "-n", "4"]
    assert ompi.launch_args(2, oversubscribe=False) == ["-n", "2"]
    assert ompi.launch_args(2, True, False) == ["--with-ft", "ulfm", "-n", "2"]
    assert mpich.launch_args(64, oversubscribe=True) == ["-n", "64"]  # hydra needs no flag
    assert mpich.launch_args(3, fault_tolerant=True)[0] == "-disable-auto-cleanup"
    assert ompi.is_segment("sm_segment.vm.0.6fc20000.1") and not mpich.is_segment("sm_x")
    intel = identify(TEXTS["intel"])  # commlib's own detection, one machine (ft_backend)
    assert intel.launch_args(2, fault_tolerant=True) == ["-disable-auto-cleanup", "-n", "2"]
    # one failure domain per rank: a hydra proxy each on MPICH, nothing needed elsewhere
    assert mpich.launch_args(2, rank_domains=True, oversubscribe=False) == [
        "-launcher", "fork", "-hosts", "127.0.0.1,127.0.0.2", "-ppn", "1", "-n", "2"]
    assert mpich.rank_domain_hosts(2) == ["127.0.0.1", "127.0.0.2"]
    assert ompi.rank_domain_args(3) == intel.rank_domain_args(3) == []
    assert ompi.rank_domain_hosts(3) is None
    with pytest.raises(ValueError, match="failure domain"):
        identify("Some MPI 1.0").rank_domain_args(2)


def test_current_is_the_library_mpi4py_loaded():
    from mpi4py import MPI
    impl = current()
    assert isinstance(impl, Implementation) and impl is current()
    assert impl == identify(MPI.Get_library_version())
    if os.environ.get("EXPECT_MPI_IMPL"):  # CI names the runtime each venv holds
        assert impl.key == os.environ["EXPECT_MPI_IMPL"], impl


@pytest.mark.mpi(min_size=2)
def test_segments_mapped_by_the_node_have_no_name():
    """After ``import commlib`` under mpiexec no shared-memory file of the implementation
    that this rank maps still has a name in /dev/shm (a killed job cannot leave it)."""
    import commlib
    from commlib.mpi import shm
    commlib.init()
    commlib.barrier()
    named = [path for path, _, still in shm.mapped() if still]
    assert named == [], f"rank {commlib.get_rank()}: still named: {named}"
    assert all(os.path.exists(p) is False for p, _, _ in shm.mapped())


def test_store_world_refused_where_the_library_cannot_join_naming_mpirun(monkeypatch):
    """Open MPI cannot be given a world from a store: refused before anything starts,
    naming the launch line to use; MPICH-ABI libraries pass."""
    import types

    from commlib.mpi import mpi_impl
    from commlib.mpi.launch import world
    job = types.SimpleNamespace(launcher="torchrun", size=4)
    monkeypatch.setattr(mpi_impl, "_current", identify(TEXTS["openmpi"]))
    with pytest.raises(RuntimeError, match=r"mpirun -n 4 python .*srun --mpi=pmix"):
        world.refuse(None, job)
    for key in ("mpich", "intel"):
        monkeypatch.setattr(mpi_impl, "_current", identify(TEXTS[key]))
        world.refuse(None, job)


TORCHRUN_PROGRAM = """
import commlib, numpy as np
commlib.init()
total = int(commlib.allreduce(np.ones(1))[0])
print(f"WORLD {commlib.get_rank()} {commlib.get_world_size()} {total}", flush=True)
"""


def test_torchrun_forms_the_world_or_is_refused_on_every_rank(tmp_path):
    """Under torchrun (2 processes): the store-backed world forms on MPICH-ABI libraries
    (an allreduce over both); on Open MPI every process fails at import with the refusal
    naming ``mpirun``, never two worlds of one process or a hang."""
    import re
    import subprocess
    import sys

    from helpers import clean_env, serial_only  # noqa: F401
    if _world_size() > 1:
        pytest.skip("launches its own torchrun; run in the serial session")
    pytest.importorskip("torch")
    program = tmp_path / "program.py"
    program.write_text(TORCHRUN_PROGRAM)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", "--monitor-interval=0.5", str(program)],
                          capture_output=True, text=True, timeout=240,
                          env=clean_env(OMP_NUM_THREADS="1"))
    out = proc.stdout + proc.stderr
    if current().store_world:
        assert proc.returncode == 0, out[-3000:]
        assert sorted(re.findall(r"WORLD (\d) 2 2", out)) == ["0", "1"], out[-3000:]
    else:
        assert proc.returncode != 0 and "WORLD" not in out, out[-3000:]
        assert out.count("cannot join the processes torchrun started") >= 2, out[-3000:]
        assert "mpirun -n 2 python program.py" in out, out[-3000:]


def _world_size() -> int:
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_size()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16"])
def test_small_integer_sums_wrap_on_overflow(dtype):
    """commlib.allreduce SUM of 8- and 16-bit integers wraps as C (and numpy, NCCL) do, at
    every count: Open MPI's AVX kernels saturate instead (open-mpi/ompi#8045: 3 ranks,
    >= 31 elements), so commlib starts Open MPI without them (mpi_impl.openmpi.INIT_ENV)."""
    import numpy as np

    import commlib
    commlib.init()
    r, n = commlib.get_rank(), commlib.get_world_size()
    info = np.iinfo(dtype)
    rng = np.random.default_rng(7)
    for count in (7, 31, 64, 280, 4099):
        values = rng.integers(info.min, info.max, size=(n, count), endpoint=True).astype(dtype)
        got = values[r].copy()
        commlib.allreduce(got)
        expected = values.sum(axis=0, dtype=dtype)
        assert np.array_equal(got, expected), \
            f"rank {r}: {dtype}[{count}]: {int((got != expected).sum())} sums differ"
    if n > 1:  # the check can fail: the saturated sums are not the wrapped ones
        wide = values.astype(np.int64).sum(axis=0)
        assert np.any((wide > info.max) | (wide < info.min))


def test_open_mpi_launch_environment_is_prepared_before_init(monkeypatch):
    import sys
    import warnings

    from commlib.mpi.mpi_impl import openmpi
    with warnings.catch_warnings(record=True) as seen:  # MPI initialized already: too late
        warnings.simplefilter("always")
        assert openmpi.prepare_environment({"OMPI_COMM_WORLD_SIZE": "2"}) == []
    assert any("OMPI_MCA_op=^avx" in str(w.message) for w in seen), seen
    monkeypatch.delitem(sys.modules, "mpi4py.MPI")  # as before `import commlib` starts MPI
    env = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}
    assert openmpi.prepare_environment(env) == ["OMPI_MCA_op"] and env["OMPI_MCA_op"] == "^avx"
    mine = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_MCA_op": "^tuned"}
    assert openmpi.prepare_environment(mine) == [] and mine["OMPI_MCA_op"] == "^tuned"
    assert openmpi.prepare_environment({"PMI_RANK": "0"}) == []  # not Open MPI's launcher
