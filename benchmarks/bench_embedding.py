"""Sharded embeddings on the synthetic CTR workload (``commlib.examples.train_ctr``):
samples/s, bytes per step and test AUC of

  (a) a replicated ``nn.EmbeddingBag`` under torch DDP over gloo (the whole table's
      gradient all-reduced every step; bytes are that gradient, gloo is not counted by
      commlib.stats()),
  (b) TorchRec: not run (``torchrec`` does not load under torch 2.13),
  (c) ``commlib.ShardedEmbeddingBag``, synchronous,
  (d) with staleness tau = 4 (Persia),
  (e) with the HET cache at pull/push bounds 0, 3, 10, 100,
  (f) with Bagpipe's lookahead,

each one ``mpiexec`` job (same seed, same samples), unlimited and under one shared link of
``--rates`` Mbit/s (``netsim.py``; needs root). Bytes per step: what rank 0 handed to MPI
(``commlib.stats()``, dense DDP exchange included).

    python benchmarks/bench_embedding.py --ranks 4 --rows 1000000 --dim 32 --rates 0,1000
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

VARIANTS = {
    "(a) replicated, torch DDP gloo": ["--replicated"],
    "(c) sharded sync": [],
    "(d) staleness 4": ["--staleness", "4"],
    "(e) cache bound 0": ["--cache-rows", "{cache}", "--pull-bound", "0", "--push-bound", "0"],
    "(e) cache bound 3": ["--cache-rows", "{cache}", "--pull-bound", "3", "--push-bound", "3"],
    "(e) cache bound 10": ["--cache-rows", "{cache}", "--pull-bound", "10", "--push-bound",
                           "10"],
    "(e) cache bound 100": ["--cache-rows", "{cache}", "--pull-bound", "100", "--push-bound",
                            "100"],
    "(f) lookahead 4": ["--lookahead", "4"],
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--cache-rows", type=int, default=20000)
    p.add_argument("--rates", default="0,1000", help="Mbit/s, 0 = unlimited")
    p.add_argument("--only", default="", help="comma-separated variant letters, e.g. a,c")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from netsim import can_shape, run_limited
    shaped, why = can_shape()
    results: dict = {"shaped": shaped, "why": why, "args": vars(args), "rates": {}}
    for rate in [float(r) for r in args.rates.split(",")]:
        label = "unlimited" if rate == 0 else f"{rate:g} Mbit/s"
        results["rates"][label] = {}
        for name, extra in VARIANTS.items():
            if args.only and name[1] not in args.only.split(","):
                continue
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
                path = fh.name
            cmd = [_mpiexec(), "-n", str(args.ranks), sys.executable,
                   "-m", "commlib.examples.train_ctr", "--rows", str(args.rows), "--dim",
                   str(args.dim), "--batch", str(args.batch), "--steps", str(args.steps),
                   "--json", path] + [a.format(cache=args.cache_rows) for a in extra]
            print(f"{label}: {name} ...", flush=True)
            code = run_limited(rate or None, cmd, timeout=args.timeout)
            if code:
                print(f"  exited {code}", flush=True)
                continue
            with open(path) as fh:
                results["rates"][label][name] = json.load(fh)
            os.unlink(path)
    report(results)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


def _mpiexec() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec") or "mpiexec"


def report(results: dict) -> None:
    a = results["args"]
    print(f"\n{a['ranks']} ranks, table {a['rows']} x {a['dim']} float32, {a['batch']} "
          f"samples/rank/step, {a['steps']} steps; shaping: {results['why']}")
    for label, rows in results["rates"].items():
        sync = rows.get("(c) sharded sync")
        print(f"\n| {label} | samples/s | x (c) | MB/step (rank 0) | test AUC | AUC - (c) |")
        print("|---|---|---|---|---|---|")
        for name, r in rows.items():
            ratio = r["samples_per_s"] / sync["samples_per_s"] if sync else float("nan")
            dauc = r["auc"] - sync["auc"] if sync else float("nan")
            print(f"| {name} | {r['samples_per_s']:.0f} | {ratio:.2f} | "
                  f"{r['bytes_per_step'] / 1e6:.3f} | {r['auc']:.4f} | {dauc:+.4f} |")
        if sync:
            print(f"teacher AUC {sync['teacher_auc']:.4f}")


if __name__ == "__main__":
    sys.exit(main())
