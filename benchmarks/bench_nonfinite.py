"""What the non-finite agreement costs: each patched path against the plain one, in the same
run, on the same buffers.

    mpiexec -n 2 python benchmarks/bench_nonfinite.py [--sizes 64K,1M,4M] [--reps 9]
        [--json PATH]

* ``minmax_uint8`` / ``sign1``: ``compressed_allreduce`` with ``nonfinite="propagate"``
  (the default: NaN chunks carried in the payload, and for sign1 residuals computed aside
  and kept only for a finite result) against ``nonfinite="raise"`` (the plain path: the
  kernel raises, residuals are updated in place). Sizes are float32 elements per rank.
* ``weights``: a weight allreduce followed by the finiteness check that ``local_sgd`` and
  ``decentralized`` make before applying an average, against the allreduce alone.
* ``qadam step``: a DDP training step of ``qadam`` after its warm-up (wide MLP, sign1)
  against the same algorithm with its bucket exchange as it was before the agreement
  (momentum and residuals updated in place, the kernel raises on non-finite input).

Blocks alternate between the two sides (who goes first alternates too); a block's time is
the slowest rank's mean per call (OSU); the ratio is patched / plain of the medians.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64K,1M,4M",
                   help="elements per rank for the collectives (binary units)")
    p.add_argument("--reps", type=int, default=9, help="timed blocks per side")
    p.add_argument("--block-ms", type=float, default=200.0, help="target block length")
    p.add_argument("--steps", type=int, default=5, help="qadam steps per block")
    p.add_argument("--width", type=int, default=1024, help="wide MLP width for qadam")
    p.add_argument("--json", default=None, help="where to write the results")
    return p.parse_args()


def compare(sync: Any, patched: Callable[[], Any], plain: Callable[[], Any], reps: int,
            block_s: float) -> dict[str, float]:
    iters = C.calibrate(sync, [patched, plain], warmup=6, target_s=block_s, lo=1, hi=10000)
    times: dict[str, list[float]] = {"patched": [], "plain": []}
    for rep in range(reps):
        order = [("patched", patched), ("plain", plain)]
        for name, fn in order if rep % 2 == 0 else order[::-1]:
            times[name].append(C.time_block(sync, fn, iters))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"patched_us": med["patched"] * 1e6, "plain_us": med["plain"] * 1e6,
            "ratio": med["patched"] / med["plain"], "iters": iters}


def collectives(sync: Any, sizes: list[int], reps: int, block_s: float) -> list[dict]:
    import torch

    from commlib.base.reduce_ops import ReduceOp
    from commlib.primitives import CompressionState, allreduce, compressed_allreduce
    from commlib.primitives.finite import all_finite
    rows = []
    rank = sync.Get_rank()
    for n in sizes:
        base = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        x = base.clone()
        for method in ("minmax_uint8", "sign1"):
            states = {"propagate": CompressionState(), "raise": CompressionState()}

            def run(mode: str, method: str = method) -> None:
                x.copy_(base)
                compressed_allreduce(x, method=method, chunk_size=2048,
                                     state=states[mode], nonfinite=mode)
            rows.append({"what": method, "numel": n,
                         **compare(sync, lambda: run("propagate"), lambda: run("raise"),
                                   reps, block_s)})

        def weights(check: bool) -> None:
            x.copy_(base)
            allreduce(x, op=ReduceOp.AVG)
            if check:
                all_finite(x)
        rows.append({"what": "weights", "numel": n,
                     **compare(sync, lambda: weights(True), lambda: weights(False), reps,
                               block_s)})
    return rows


def qadam_step(sync: Any, args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    import commlib
    from commlib.algorithms.qadam import QAdam, QAdamOptimizer
    from commlib.base.reduce_ops import ReduceOp
    from commlib.primitives import compressed_allreduce
    from models import WideMLP

    class PlainQAdam(QAdam):
        """qadam's exchange before the agreement: in-place momentum and residuals."""

        def on_bucket_ready(self, ctx: Any, bucket: Any) -> Any:
            if not self.compressing:
                return super().on_bucket_ready(ctx, bucket)
            m = self._momentum[bucket.index]
            with torch.no_grad():
                self._update_momentum(bucket, m, m)
                u = m.div_(self._denom[bucket.index]).clamp_(-self.max_update,
                                                             self.max_update)
            compressed_allreduce(u, op=ReduceOp.AVG, group=ctx.group, method=self.compression,
                                 chunk_size=self.chunk_size,
                                 state=self._states[bucket.index], nonfinite="raise")
            with torch.no_grad():
                u.mul_(self._denom[bucket.index])

        def after_backward(self, ctx: Any) -> None:
            pass

    rank = sync.Get_rank()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 784, generator=g), torch.randint(0, 10, (64,), generator=g)
    sides = {}
    for name, algo in (("patched", QAdam(warmup_steps=2)), ("plain", PlainQAdam(warmup_steps=2))):
        torch.manual_seed(0)
        ddp = commlib.DistributedDataParallel(WideMLP(width=args.width), algorithm=algo)
        opt = QAdamOptimizer(ddp.parameters(), lr=1e-4)

        def step(ddp: Any = ddp, opt: Any = opt) -> None:
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        for _ in range(4):  # through the warm-up into the compressed phase
            step()
        sides[name] = (ddp, step)

    def block(step: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(args.steps):
                step()
        return run
    result = compare(sync, block(sides["patched"][1]), block(sides["plain"][1]), args.reps,
                     args.block_ms / 1e3)
    for ddp, _ in sides.values():
        ddp.close()
    return {"what": "qadam step", "numel": sum(p.numel() for p in
                                               sides["patched"][0].module.parameters()),
            **{k: (v / args.steps if k.endswith("_us") else v) for k, v in result.items()}}


def main() -> None:
    args = parse_args()
    import torch
    from mpi4py import MPI

    import commlib
    torch.set_num_threads(1)
    commlib.init()
    sync = MPI.COMM_WORLD.Dup()
    sizes = [C.parse_size(s) for s in args.sizes.split(",")]
    rows = collectives(sync, sizes, args.reps, args.block_ms / 1e3) + [qadam_step(sync, args)]
    if sync.Get_rank() == 0:
        print(C.format_table(
            ["what", "elements", "patched us", "plain us", "patched / plain"],
            [[r["what"], r["numel"], C.fmt(r["patched_us"], 1), C.fmt(r["plain_us"], 1),
              C.fmt(r["ratio"], 3)] for r in rows],
            title=f"non-finite agreement, {sync.Get_size()} ranks"))
        path = C.write_json(args.json or C.default_path("bench_nonfinite", ".json"),
                            {"environment": C.environment(sync.Get_size()), "rows": rows})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
