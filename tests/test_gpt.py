"""The GPT workload of the benchmarks (benchmarks/gpt.py) at its tiny size: the corpus
split is deterministic and disjoint, the model is causal, and a few steps learn the text
(validation loss well under a byte's entropy), which training on random bytes does not
(negative control); under mpiexec, DiLoCo and Streaming DiLoCo train it on every replica."""
import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import commlib  # noqa: E402
import gpt  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")
BYTES = 400_000
_CORPUS = {}


def data():
    if not _CORPUS:
        _CORPUS.update(gpt.corpus(BYTES))
    return _CORPUS


def test_corpus_split_is_deterministic_and_disjoint():
    files = gpt.stdlib_files()
    val = [f for f in files if gpt.zlib.crc32(f.encode()) % 10 == 0]
    assert len(files) > 100 and 0.05 < len(val) / len(files) < 0.2
    again = gpt.corpus(BYTES)
    c = data()
    assert c["digest"] == again["digest"] and torch.equal(c["train"], again["train"])
    assert c["train"].numel() == c["val"].numel() == BYTES
    assert c["train"][:2000].tolist() != c["val"][:2000].tolist()
    assert b"def " in bytes(c["val"][:20000].tolist())


def test_gpt_is_causal_and_sized():
    assert 1e6 <= sum(p.numel() for p in gpt.build().parameters()) <= 10e6
    m = gpt.build(gpt.TINY)
    x = torch.randint(0, 256, (2, 16))
    y = x.clone()
    y[:, 10:] = torch.randint(0, 256, (2, 6))
    with torch.no_grad():
        a, b = m(x), m(y)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def fit(train_bytes, steps=40, seed=0):
    m = gpt.build(gpt.TINY, seed)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = gpt.batch(train_bytes, 16, gpt.TINY.context, g)
        opt.zero_grad()
        gpt.loss(m, x, y).backward()
        opt.step()
    return gpt.val_loss(m, data()["val"], gpt.TINY.context, windows=32)


def test_tiny_gpt_learns_the_text_and_not_from_noise():
    learned = fit(data()["train"])
    noise = fit(torch.randint(0, 256, (BYTES,), dtype=torch.uint8))
    threshold = 0.75 * math.log(256)
    assert learned < threshold, learned
    assert noise > threshold, noise           # negative control: the check can fail


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm,kwargs", [
    ("diloco", dict(sync_every=4)),
    ("streaming_diloco", dict(sync_every=4, num_fragments=2, fragment_sync_delay=1,
                              quantize="int4"))])
def test_gpt_trains_on_every_replica(algorithm, kwargs):
    """Each rank its own byte windows; every replica's validation loss ends well under the
    initial one."""
    rank = commlib.get_rank()
    m = gpt.build(gpt.TINY)
    init = gpt.val_loss(m, data()["val"], gpt.TINY.context, windows=16)
    ddp = commlib.DistributedDataParallel(m, algorithm=algorithm, outer_momentum=0.5,
                                          **kwargs)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    try:
        for _ in range(24):
            x, y = gpt.batch(data()["train"], 8, gpt.TINY.context, g)
            opt.zero_grad()
            gpt.loss(ddp, x, y).backward()
            opt.step()
        ddp(x[:1])   # the last outer step
        losses = commlib.allgather(torch.tensor([gpt.val_loss(m, data()["val"],
                                                              gpt.TINY.context, 16)]))
        assert float(losses.max()) < init - 1.0, (losses, init)
    finally:
        ddp.close()
