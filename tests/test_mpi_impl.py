"""commlib.mpi_impl: each implementation recognised from its own version text (as the
wheels print it), its launcher options, and the shared-memory rule of commlib.shm under the
implementation being tested (every rank's segments lose their names once the node mapped
them)."""
import os

import pytest

from commlib.mpi_impl import Implementation, current, identify

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
    with pytest.raises(ValueError, match="Intel MPI"):
        identify(TEXTS["intel"]).launch_args(2, fault_tolerant=True)


def test_current_is_the_library_mpi4py_loaded():
    from mpi4py import MPI
    impl = current()
    assert isinstance(impl, Implementation) and impl is current()
    assert impl == identify(MPI.Get_library_version())
    if os.environ.get("COMMLIB_EXPECT_MPI"):  # CI names the runtime each venv holds
        assert impl.key == os.environ["COMMLIB_EXPECT_MPI"], impl


@pytest.mark.mpi(min_size=2)
def test_segments_mapped_by_the_node_have_no_name():
    """After ``import commlib`` under mpiexec no shared-memory file of the implementation
    that this rank maps still has a name in /dev/shm (a killed job cannot leave it)."""
    import commlib
    from commlib import shm
    commlib.init()
    commlib.barrier()
    named = [path for path, _, still in shm.mapped() if still]
    assert named == [], f"rank {commlib.get_rank()}: still named: {named}"
    assert all(os.path.exists(p) is False for p, _, _ in shm.mapped())
