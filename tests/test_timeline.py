"""The communication timeline: a DDP run writes one valid Chrome trace per rank with one
bucket-exchange event per bucket per step and one event per collective (operation, group,
bytes, sequence number, thread); merge() puts the ranks into one trace; stats() times
every operation. (commlib.init() starting it from the option: tests/test_example.py.)"""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import commlib  # noqa: E402
from commlib.services import timeline  # noqa: E402

STEPS = 3


def trace_problems(events, n_buckets, steps, group_size):
    """What is wrong with one rank's trace of ``steps`` DDP steps (empty: nothing)."""
    bad = []
    names = {e["tid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    for e in spans:
        if not (e["dur"] >= 0 and e["ts"] >= 0 and e["tid"] in names):
            bad.append(f"bad times or thread: {e}")
    buckets = sorted((e["args"]["step"], e["args"]["bucket"]) for e in spans
                     if e["name"] == "bucket_exchange")
    want = sorted((s, b) for s in range(steps) for b in range(n_buckets))
    if buckets != want:
        bad.append(f"bucket events {buckets}, expected {want}")
    ddp = [e for e in spans if e["cat"] == "collective" and e["args"]["group_size"] == group_size
           and names[e["tid"]] == "commlib-comm" and e["name"] == "allreduce"]
    if len(ddp) != n_buckets * steps:
        bad.append(f"{len(ddp)} allreduce events on the communication thread")
    for e in spans:
        if e["cat"] == "collective" and not {"group", "seq", "bytes", "bus_bytes"} <= set(
                e["args"]):
            bad.append(f"collective event without its fields: {e}")
    seqs = {}
    for e in sorted((e for e in spans if e["cat"] == "collective"), key=lambda e: e["ts"]):
        seqs.setdefault((e["args"]["group"], e["tid"]), []).append(e["args"]["seq"])
    if any(s != sorted(s) for s in seqs.values()):
        bad.append("sequence numbers out of order")
    return bad


@pytest.mark.mpi
def test_ddp_run_writes_one_bucket_event_per_bucket_per_step(tmp_path_factory,
                                                              one_thread_per_rank):
    rank, n = commlib.get_rank(), commlib.get_world_size()
    base = commlib.broadcast(np.frombuffer(
        str(tmp_path_factory.mktemp("tl") / "trace").encode().ljust(256), np.uint8).copy())
    base = bytes(base).decode().strip()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ddp = commlib.DistributedDataParallel(model, bucket_cap_mb=0.00005)
    path = timeline.start(base)
    try:
        commlib.stats(reset=True)
        for step in range(STEPS):
            ddp(torch.randn(3, 4)).sum().backward()
        counted = commlib.stats()
    finally:
        assert timeline.stop() == path
        ddp.close()
    assert path == f"{base}.rank{rank}.json"
    with open(path) as f:
        events = json.load(f)  # valid JSON
    n_buckets = len(ddp._ctx.buckets)
    assert n_buckets >= 3
    assert trace_problems(events, n_buckets, STEPS, n) == []
    # negative controls: the checker rejects a missing bucket event and a duplicated one
    drop = next(i for i, e in enumerate(events) if e["name"] == "bucket_exchange")
    assert trace_problems(events[:drop] + events[drop + 1:], n_buckets, STEPS, n)
    assert trace_problems(events + [events[drop]], n_buckets, STEPS, n)
    # stats() times every operation it counts; nothing after stop() is recorded
    assert counted["allreduce"]["seconds"] > 0
    commlib.allreduce(np.ones(3))
    with open(path) as f:
        assert len(json.load(f)) == len(events)
    commlib.barrier()
    if rank == 0:
        out = base + ".merged.json"
        paths = [timeline.rank_path(base, r) for r in range(n)]
        count = timeline.merge(paths, out)
        with open(out) as f:
            merged = json.load(f)["traceEvents"]
        assert count == len(merged) == sum(len(timeline.load(p)) for p in paths)
        assert {e["pid"] for e in merged} == set(range(n))
    commlib.barrier()


def test_start_needs_a_path():
    if commlib.options.timeline is None:
        with pytest.raises(ValueError, match="path"):
            timeline.start()
