"""The GPT time-to-accuracy grid inside a wall-time budget, then every table and plot.

    python benchmarks/bench_time_to_accuracy_grid.py --budget-min 25 \\
        --out benchmarks/results --readme docs/benchmarks/time-to-accuracy.md -- <bench_time_to_accuracy args>

(``benchmarks/run_tta_gpt.sh`` gives the arguments of the headline run.) One
``bench_time_to_accuracy.py`` job per (shape, rate, seed), in priority order: seed 0 of
every shaped (shape, rate), the unshaped calibration run of each shape (seed 0: the cost
model's base), the other seeds, then ``--extra-rates`` (10 Gbit/s) at seed 0. A job starts
only when the time used plus the longest job so far (times ``--margin``) fits in the
budget; a job that does not fit is skipped and listed. Each job writes its own JSON under
``OUT/tta_gpt_parts/`` (a failed job is reported and the grid goes on), then:

* ``OUT/tta_gpt.json``, ``.md``, ``.png``: the joined panels (medians over the seeds that
  ran), the headline table against the issue's targets, loss against wall time per shape;
* ``OUT/cost_model_gpt_tta.json``, ``.md``, ``.png``: the cost model calibrated on the
  unshaped runs and validated on every shaped run (error per run), the bytes check, which
  algorithm on the emulated cluster (measured and predicted) and at scale;
* ``OUT/tta_gpt_section.md``: all of it as one Markdown section, spliced into
  ``--readme`` between ``<!-- tta-gpt:begin -->`` and ``<!-- tta-gpt:end -->`` (``--marker``
  names another pair: ``tta-gpt-2x1`` for the link-bound 2x1 grid).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
BENCH = os.path.join(HERE, "bench_time_to_accuracy.py")
def markers(name: str = "tta-gpt") -> tuple[str, str]:
    """The comment pair a grid's section is spliced between."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


BEGIN, END = markers()


def jobs(shapes: list[str], rates: list[float], seeds: list[int], calibrate: bool,
         extra: list[float]) -> list[tuple[str, float, int]]:
    """(shape, rate, seed) in priority order (module doc)."""
    out = [(s, r, seeds[0]) for r in rates for s in shapes]
    if calibrate:
        out += [(s, 0.0, seeds[0]) for s in shapes]
    out += [(s, r, k) for k in seeds[1:] for r in rates for s in shapes]
    out += [(s, r, seeds[0]) for r in extra for s in shapes]
    return out


def run_grid(args: argparse.Namespace, bench_args: list[str]) -> dict:
    parts = os.path.join(os.path.abspath(args.out), "tta_gpt_parts")
    os.makedirs(parts, exist_ok=True)
    budget = args.budget_min * 60
    started = time.monotonic()
    done, skipped, failed = [], [], []
    longest, before, pieces, budgets = 0.0, 0.0, 0, 0.0
    progress = os.path.join(args.out, "tta_gpt_grid.json")
    if getattr(args, "resume", False) and os.path.exists(progress):
        with open(progress) as fh:
            old = json.load(fh)
        # a part is found by its file name under OUT's parts (the grid may have been run
        # from another checkout, e.g. a git worktree since removed)
        done = [dict(j, path=os.path.join(parts, os.path.basename(j["path"])))
                for j in old["done"]]
        done = [j for j in done if os.path.exists(j["path"])]
        longest = max([j["job_s"] for j in done], default=0.0)
        before = old.get("grid_s", 0.0)
        pieces, budgets = old.get("pieces", 1), old.get("budget_s", 0.0)
    finished = {(j["shape"], float(j["rate_mbit"]), int(j["seed"])) for j in done}
    todo = jobs(args.shapes.split(","), [float(r) for r in args.rates.split(",")],
                [int(k) for k in args.seeds.split(",")], not args.no_calibrate,
                [float(r) for r in args.extra_rates.split(",") if r])
    todo = [t for t in todo if t not in finished]
    for shape, rate, seed in todo:
        used = time.monotonic() - started
        if done and used + longest * args.margin > budget:
            skipped.append(f"{shape} {rate:g}Mbit seed {seed}")
            print(f"skip {shape} {rate:g} Mbit/s seed {seed}: {used:.0f} s used, the "
                  f"longest job took {longest:.0f} s, budget {budget:.0f} s", flush=True)
            continue
        path = os.path.join(parts, f"{shape}_{rate:g}_{seed}.json")
        cmd = [sys.executable, BENCH, "--models", "gpt", "--shapes", shape, "--rates",
               f"{rate:g}", "--seeds", str(seed), "--json", path, *bench_args]
        print(f"[{used:6.0f} s] {shape} {rate:g} Mbit/s seed {seed}", flush=True)
        t0 = time.monotonic()
        with open(path[:-5] + ".log", "w") as log:   # each job's own output
            code = subprocess.call(cmd, stdout=None if args.verbose else log,
                                   stderr=subprocess.STDOUT)
        took = time.monotonic() - t0
        longest = max(longest, took)
        (done if code == 0 else failed).append(
            {"shape": shape, "rate_mbit": rate, "seed": seed, "job_s": took, "path": path,
             "exit": code})
        print(f"         took {took:.0f} s" + ("" if code == 0 else f", EXIT {code}"),
              flush=True)
        with open(progress, "w") as fh:   # what a --resume of a stopped grid starts from
            json.dump({"done": done, "failed": failed, "pieces": pieces + 1,
                       "budget_s": budgets + budget,
                       "grid_s": before + time.monotonic() - started}, fh, indent=1)
    return {"done": done, "skipped": skipped, "failed": failed, "pieces": pieces + 1,
            "grid_s": before + time.monotonic() - started, "budget_s": budgets + budget}


def render(args: argparse.Namespace, grid: dict) -> str:
    """Tables, plots, the cost model; the Markdown section (returned)."""
    import bench_time_to_accuracy as B
    import cost_model as CM
    files = [j["path"] for j in grid["done"]]
    if not files:
        raise SystemExit("no job finished: nothing to render")
    o = args.out
    tta = os.path.join(o, "tta_gpt")
    B.main(["--combine", ",".join(files), "--json", tta + ".json", "--plot", tta + ".png",
            "--markdown", tta + ".md"])
    cm = os.path.join(o, "cost_model_gpt_tta")
    CM.main(["--calibrate", tta + ".json", "--validate", tta + ".json", "--workload", "gpt",
             "--json", cm + ".json", "--markdown", cm + ".md", "--plot", cm + ".png"])
    with open(tta + ".json") as fh:
        result = json.load(fh)
    cfg = result["config"]
    rel = os.path.relpath(o, os.path.dirname(os.path.abspath(args.readme or o)))
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()
    steps = cfg["epochs"] * cfg["gpt_steps_per_epoch"]
    failed = [f"{j['shape']} {j['rate_mbit']:g} s{j['seed']} (exit {j['exit']}, log "
              f"{os.path.basename(j['path'])[:-5]}.log)" for j in grid["failed"]]
    head = [
        f"Generated by `benchmarks/run_tta_gpt.sh` on {when} (load average before "
        f"rendering {load[0]:.1f}; {os.cpu_count()} cores); emulation: "
        f"{result['panels'][next(iter(result['panels']))]['runs'][0].get('emulation', '?')}.",
        f"GPT `{cfg['gpt_size']}`, {steps} steps ({cfg['epochs']} epochs x "
        f"{cfg['gpt_steps_per_epoch']}), per-rank batch {cfg['batch']}, AdamW lr "
        f"{cfg['gpt_lr']} (cosine), evaluation every {cfg['eval_every']} steps; target: "
        f"{result['target_rule']}.",
        f"Grid: {len(grid['done'])} jobs in {grid['grid_s']:.0f} s of a "
        f"{grid['budget_s']:.0f} s budget"
        + (f" ({grid['pieces']} locked pieces, `--resume`)" if grid.get("pieces", 1) > 1
           else "") + " (job times "
        + ", ".join(f"{j['shape']} {j['rate_mbit']:g} s{j['seed']} {j['job_s']:.0f} s"
                    for j in grid["done"]) + ")"
        + (f"; skipped (budget): {', '.join(grid['skipped'])}" if grid["skipped"] else "")
        + (f"; FAILED: {', '.join(failed)}" if failed else "") + ".", ""]
    with open(tta + ".md") as fh:
        tables = fh.read()
    with open(cm + ".md") as fh:
        model = fh.read()
    section = "\n".join(head) + "\n" + tables + \
        f"\n![GPT validation loss against wall time]({rel}/tta_gpt.png)\n\n" + model + \
        f"\n![cost model at scale, GPT]({rel}/cost_model_gpt_tta.png)\n"
    with open(os.path.join(o, "tta_gpt_section.md"), "w") as fh:
        fh.write(section)
    with open(os.path.join(o, "tta_gpt_grid.json"), "w") as fh:
        json.dump(grid, fh, indent=1)
    return section


def splice(readme: str, section: str, marker: str = "tta-gpt") -> None:
    """Replace what lies between the ``marker`` pair of ``readme`` with ``section``."""
    BEGIN, END = markers(marker)
    with open(readme) as fh:
        text = fh.read()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme}: no {BEGIN} ... {END} markers (the GPT grids' sections "
                         f"are in docs/benchmarks/time-to-accuracy.md; the section is also in "
                         f"OUT/tta_gpt_section.md: --render-only --readme PAGE splices it)")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(readme, "w") as fh:
        fh.write(head + BEGIN + "\n" + section.rstrip() + "\n" + END + tail)
    print(f"spliced into {readme}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-min", type=float, default=25.0)
    p.add_argument("--margin", type=float, default=1.1,
                   help="a job starts when used + longest job x this fits the budget")
    p.add_argument("--shapes", default="2x2,4x1")
    p.add_argument("--rates", default="1000,100")
    p.add_argument("--extra-rates", default="10000", help="seed 0 only, last")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--no-calibrate", action="store_true")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--readme", default=None, help="splice the section into this file")
    p.add_argument("--marker", default="tta-gpt",
                   help="between <!-- MARKER:begin --> and <!-- MARKER:end --> of --readme")
    p.add_argument("--render-only", action="store_true",
                   help="no jobs: render OUT/tta_gpt_grid.json's finished jobs again")
    p.add_argument("--verbose", action="store_true", help="show each job's output")
    p.add_argument("--resume", action="store_true",
                   help="keep the jobs OUT/tta_gpt_grid.json lists as done; run the rest")
    args = p.parse_args(own)
    if args.render_only:
        with open(os.path.join(args.out, "tta_gpt_grid.json")) as fh:
            grid = json.load(fh)
    else:
        grid = run_grid(args, bench_args)
    section = render(args, grid)
    if args.readme:
        splice(args.readme, section, args.marker)
    print(f"grid: {len(grid['done'])} jobs in {grid['grid_s']:.0f} s; skipped "
          f"{len(grid['skipped'])}, failed {len(grid['failed'])}")
    return 1 if grid["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
