"""The env:// variables commlib sets from MPI at import, the launcher check of
commlib.init, and the registration of the torch backend in either import order."""
import os
import subprocess
import sys

import numpy as np
import pytest

import commlib
from commlib.core import runtime
from commlib.mpi import mpi_env
from helpers import clean_env, serial_only


@pytest.mark.mpi
def test_rendezvous_variables_agree_with_mpi():
    rank, n = commlib.get_rank(), commlib.get_world_size()
    if n == 1:
        assert mpi_env.publish() == {}          # singleton: nothing to agree on
        return
    env = os.environ
    assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == str(n)
    assert env["LOCAL_RANK"] == str(commlib.get_local_rank())
    assert env["LOCAL_WORLD_SIZE"] == str(commlib.get_local_size())
    ports = commlib.allgather(np.array([int(env["MASTER_PORT"])]))
    assert len(set(ports.ravel().tolist())) == 1
    if commlib.get_local_size() == n:
        assert env["MASTER_ADDR"] == "127.0.0.1"
    assert mpi_env.publish() == {}              # once per process


def test_master_address_is_the_route_to_another_node():
    mine = mpi_env.host_addresses()
    assert all(not ip.startswith("127.") for ip in mine)
    routes = {"10.1.2.3": "10.1.2.1"}
    hosts = [("node0", ["10.1.2.1"] + mine), ("node0", mine), ("node1", ["10.1.2.3"])]
    assert mpi_env.choose_master_addr(hosts, routes.get) == "10.1.2.1"
    # No route found: rank 0's own first non-loopback address, else its name.
    assert mpi_env.choose_master_addr([("a", ["10.9.9.9"]), ("b", ["10.0.0.7"])],
                                      lambda ip: None) == "10.9.9.9"
    assert mpi_env.choose_master_addr([("a", []), ("b", [])], lambda ip: None) \
        == __import__("socket").getfqdn()
    if mine:  # the real routing table: towards this host's own address, from it
        assert mpi_env.choose_master_addr([("a", mine), ("a", mine)],
                                          mpi_env.route_source) == mine[0]


@serial_only  # the check concerns worlds of one MPI process
def test_launcher_check_names_torchrun_and_the_fix():
    with pytest.raises(commlib.CommError) as info:
        runtime.check_launcher({"WORLD_SIZE": "4", "RANK": "3", "TORCHELASTIC_RUN_ID": "x"})
    text = str(info.value)
    assert "rank 3 of WORLD_SIZE=4" in text and "torchrun" in text and "mpiexec -n 4" in text
    with pytest.raises(commlib.CommError, match="not an MPI launcher"):
        runtime.check_launcher({"WORLD_SIZE": "2"})
    for fine in ({}, {"WORLD_SIZE": "1"}, {"WORLD_SIZE": ""}, {"WORLD_SIZE": "x"}):
        runtime.check_launcher(fine)


def test_launcher_world_from_the_environment_alone():
    """How import commlib knows it runs under an MPI launcher before any user code can fail
    (commlib.core.exits arms the abort-on-exception hook then)."""
    assert mpi_env.launcher_world({}) is None
    assert mpi_env.launcher_world({"PMI_RANK": "1", "PMI_SIZE": "4"}) == (1, 4)      # hydra
    assert mpi_env.launcher_world({"OMPI_COMM_WORLD_RANK": "0",
                                   "OMPI_COMM_WORLD_SIZE": "2"}) == (0, 2)           # Open MPI
    assert mpi_env.launcher_world({"PMI_RANK": "x", "PMI_SIZE": "2"}) is None
    assert mpi_env.launcher_world({"PMI_RANK": "2", "PMI_SIZE": "2"}) is None


def _python(code: str) -> str:
    env = {k: v for k, v in clean_env().items()
           if k not in mpi_env.VARIABLES + ("TORCHELASTIC_RUN_ID", "GROUP_RANK")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@serial_only  # starts its own Python processes
def test_numpy_only_users_never_load_torch():
    assert _python("import sys, numpy, commlib; commlib.allreduce(numpy.ones(2)); "
                   "print('torch' in sys.modules)") == "False"


@serial_only  # starts its own Python processes
@pytest.mark.parametrize("first", ["commlib", "torch"])
def test_backend_registered_in_either_import_order(first):
    second = "torch" if first == "commlib" else "commlib"
    out = _python(f"import {first}, {second}, torch.distributed as dist; "
                  f"print('commlib' in dist.Backend.backend_list, "
                  f"dist.Backend.backend_capability.get('commlib'), "
                  f"dist.Backend.default_device_backend_map['cpu'])")
    assert out == "True ['cpu', 'cuda'] gloo"
