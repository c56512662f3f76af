"""hvd.elastic on commlib's fault-tolerant mode: a Horovod-style elastic script
(tests/horovod_examples/elastic_train.py: TorchState, ElasticSampler, hvd.elastic.run, a
commit every 2 steps) at 3 ranks, one rank SIGKILLed right after its optimizer step of an
uncommitted step (launched so that a rank can die alone: elastic_common.per_rank_hosts,
one hydra proxy per rank and -disable-auto-cleanup on MPICH, --with-ft ulfm on Open MPI).

The survivors must finish; the state they go on from is the last commit (the ledger, a
state value, holds the committed steps only: the uncommitted 3-rank step is redone at 2
ranks); within each epoch the ledger's global batches are a permutation of the dataset
(no sample lost or repeated after the sampler re-deals the rest over the survivors); the
final weight equals, bit for bit, a replay of the ledger in plain torch (float64; the
gradient is a sum of integer features, exact in any order) - the run that shrinks at the
same step; the reset callback saw the new world size. Negative control: the same kill with
the sampler left out of the state (not restored, not re-dealt) is rejected. Outside
fault-tolerant mode ``run`` raises.
"""
from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
from elastic_common import (  # noqa: E402
    HERE,
    fault_tolerant_launch,  # noqa: E402,F401 - skips where refused
    run_job,
)
from helpers import serial_only  # noqa: E402

PROGRAM = os.path.join(HERE, "horovod_examples", "elastic_train.py")
pytestmark = [serial_only, pytest.mark.timeout(400)]
KILL_AT = 4   # 0-based global step: the 5th; the last commit is after the 4th


def job(tmp_path, *argv: str) -> dict:
    status, _, out, left = run_job(3, [PROGRAM, str(tmp_path), "--victim", "2", "--at",
                                       str(KILL_AT), *argv], 150, COMMLIB_FAULT_TOLERANT="1",
                                   COMMLIB_TIMEOUT="60")
    assert status != -9, f"hang\n{out[-3000:]}"
    assert not left, f"processes {left} were left running"
    found = {}
    for r in range(3):
        path = os.path.join(str(tmp_path), f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                found[r] = json.load(f)
    assert sorted(found) == [0, 1], f"ranks {sorted(found)} finished\n{out[-3000:]}"
    return found


def problems(r: dict) -> str:
    """'' when rank result ``r`` is right (see the module docstring), else what is not."""
    ledger = r["ledger"]
    sizes = [n for _, n, _ in ledger]
    if sizes[:KILL_AT] != [3] * KILL_AT or set(sizes[KILL_AT:]) != {2}:
        return f"world sizes per committed step {sizes}"
    for epoch in (0, 1):
        seen = sorted(i for e, _, everyone in ledger if e == epoch for b in everyone for i in b)
        if seen != list(range(48)):
            return f"epoch {epoch}: samples lost or repeated: {seen}"
    features = torch.randint(-4, 5, (48, 4), generator=torch.Generator().manual_seed(7)).double()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.125, momentum=0.5)
    for _, n, everyone in ledger:
        g = features[[i for b in everyone for i in b]].sum(0, keepdim=True)
        model.weight.grad = g.mul_(1.0 / n)
        opt.step()
    want = [float(w).hex() for w in model.weight.detach().reshape(-1)]
    if r["weight"] != want:
        return f"weight {r['weight']} != the replay's {want}"
    if r["sizes"] != [2]:
        return f"reset callbacks saw sizes {r['sizes']}"
    return ""


@pytest.mark.usefixtures("fault_tolerant_launch")
def test_elastic_run_survives_a_kill(tmp_path):
    found = job(tmp_path)
    for rank, r in found.items():
        assert not problems(r), f"rank {rank}: {problems(r)}"
    assert found[0] == found[1]
    assert len(found[0]["ledger"]) == KILL_AT + 24 // 4 + 48 // 4
    broken = tmp_path / "broken"
    broken.mkdir()
    bad = job(broken, "--broken")
    assert all(problems(r) for r in bad.values()), \
        "the checks did not reject a run whose sampler is not part of the state"


def test_elastic_run_needs_fault_tolerant_mode():
    import commlib.horovod as hvd
    hvd.init()
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, epoch=3)
    assert state.epoch == 3
    with pytest.raises(RuntimeError, match="COMMLIB_FAULT_TOLERANT"):
        hvd.elastic.run(lambda s: None)(state)
