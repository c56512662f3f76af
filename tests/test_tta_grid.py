"""The GPT time-to-accuracy pipeline's pure parts (benchmarks/bench_time_to_accuracy_grid.py
and its renderers) on the committed 2x2 GPT smoke run: the grid's priority order, seeds of
one panel joined from several files and summarized again, the headline and cost-model
Markdown generated from the runs, the README splice; each with the case it must reject."""
import copy
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
import bench_time_to_accuracy as B  # noqa: E402
import bench_time_to_accuracy_grid as G  # noqa: E402
import cost_model as CM  # noqa: E402
from bench_time_to_accuracy_contenders import contender, design  # noqa: E402
from bench_time_to_accuracy_report import headline_markdown  # noqa: E402

SMOKE = os.path.join(HERE, "..", "benchmarks", "results", "tta_gpt_tiny_2x2_smoke.json")


def test_grid_order_puts_seed_zero_and_calibration_first():
    order = G.jobs(["2x2", "4x1"], [1000.0, 100.0], [0, 1, 2], True, [10000.0])
    assert order[:6] == [("2x2", 1000.0, 0), ("4x1", 1000.0, 0), ("2x2", 100.0, 0),
                         ("4x1", 100.0, 0), ("2x2", 0.0, 0), ("4x1", 0.0, 0)]
    assert order[-2:] == [("2x2", 10000.0, 0), ("4x1", 10000.0, 0)]
    assert len(order) == len(set(order)) == 16
    assert all(r != 0.0 for _, r, _ in G.jobs(["2x2"], [1000.0], [0, 1], False, []))


def test_seeds_of_one_panel_join_and_resummarize(tmp_path):
    with open(SMOKE) as fh:
        base = json.load(fh)
    key = next(iter(base["panels"]))
    other = copy.deepcopy(base)
    run = other["panels"][key]["runs"][0]
    run["seed"] = 1
    for row in run["contenders"].values():   # a second seed, 10 % slower everywhere
        for p in row["curve"]:
            p["wall_s"] *= 1.1
    B.score(run, base["tolerance"], base["config"]["loss_tolerance"])
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(base))
    b.write_text(json.dumps(other))
    joined = B.combine([str(a), str(b)])["panels"][key]
    assert [r["seed"] for r in joined["runs"]] == [0, 1]
    assert joined["summary"]["gradient_allreduce"]["seeds"] == 2
    t0 = base["panels"][key]["runs"][0]["contenders"]["diloco"]["time_to_target_s"]
    assert joined["summary"]["diloco"]["time_to_target_s"] == pytest.approx(1.05 * t0)
    # the same seed twice is one run, not two (the later file's)
    again = B.combine([str(a), str(a)])["panels"][key]
    assert [r["seed"] for r in again["runs"]] == [0]


def test_headline_and_cost_model_markdown_come_from_the_runs(tmp_path):
    with open(SMOKE) as fh:
        result = json.load(fh)
    text = headline_markdown(result)
    s = next(iter(result["panels"].values()))["summary"]
    best = min((r["time_to_target_s"], n) for n, r in s.items()
               if not n.startswith("_") and n not in ("gradient_allreduce",
               "gradient_allreduce_hier", "torch_ddp_gloo", "torch_ddp_powersgd",
               "control_nocomm") and r["time_to_target_s"] is not None)[1]
    assert f"| {best} |" in text and "<= 0.25" in text
    md = tmp_path / "cm.md"
    # the smoke run calibrates itself: every step-time error is 0
    assert CM.main(["--calibrate", SMOKE, "--validate", SMOKE, "--workload", "gpt",
                    "--markdown", str(md)]) == 0
    out = md.read_text()
    assert "no step-time validation" in out      # the smoke run is shaped: nothing to calibrate
    rows = CM.validate(CM._load([SMOKE], True), CM.calibrate(CM._load([SMOKE], True)))
    from cost_model_report import validation_markdown
    table = validation_markdown(rows)
    assert "+0.0 (s0)" in table and "Runs within 20 %: " in table


def test_async_model_average_in_steps_on_the_gpt():
    assert contender("async_model_average", "gpt")[1] == {"sync_every_steps": 4,
                                                          "warmup_steps": "epoch"}
    assert contender("local_sgd", "gpt")[1] == {"sync_every": 2}
    assert contender("local_sgd", "mlp")[1] == {"sync_every": 4}
    assert contender("powersgd", "gpt", ["powersgd.rank=2"])[1]["rank"] == 2
    assert contender("powersgd", "mlp", ["diloco.sync_every=2"])[1]["rank"] == 4
    with pytest.raises(ValueError, match="--set"):
        contender("powersgd", "gpt", ["powersgd.rank"])
    assert contender("async_model_average", "mlp")[1] == {"sync_interval_ms": 50}
    assert design("async_model_average", {"sync_every_steps": 4}) == 0.25
    assert design("async_model_average", {"sync_interval_ms": 50}) is None
    assert design("streaming_diloco", {"sync_every": 8, "quantize": "int4"}) == 1 / 64
    assert CM.bytes_ratio("async_model_average", {"sync_every_steps": 4}) == (0.25, 1.0)


def test_splice_replaces_only_between_the_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"head\n{G.BEGIN}\nold\n{G.END}\ntail\n")
    G.splice(str(readme), "new table\n")
    assert readme.read_text() == f"head\n{G.BEGIN}\nnew table\n{G.END}\ntail\n"
    G.splice(str(readme), "newer\n")
    assert readme.read_text().count("new") == 1
    bare = tmp_path / "bare.md"
    bare.write_text("no markers\n")
    with pytest.raises(SystemExit):
        G.splice(str(bare), "x")


def test_grid_skips_what_the_budget_cannot_hold(tmp_path, monkeypatch):
    """Jobs are real processes (a stand-in script that only takes its time): the first
    always runs, a later one starts only if the longest so far still fits."""
    job = tmp_path / "job.py"
    job.write_text("import sys, time\ntime.sleep(0.4)\nsys.exit('4x1' in sys.argv)\n")
    monkeypatch.setattr(G, "BENCH", str(job))
    args = G.argparse.Namespace(out=str(tmp_path), budget_min=1.0 / 60, margin=1.1,
                                shapes="2x2,4x1", rates="1000", seeds="0,1",
                                no_calibrate=True, extra_rates="", verbose=False)
    grid = G.run_grid(args, [])
    ran = [(j["shape"], j["seed"]) for j in grid["done"] + grid["failed"]]
    assert ran[0] == ("2x2", 0) and len(ran) < 4, grid
    assert len(ran) + len(grid["skipped"]) == 4, grid
    assert all(j["shape"] == "4x1" for j in grid["failed"]), grid   # a failed job is listed
    generous = G.argparse.Namespace(**{**vars(args), "budget_min": 10.0})
    again = G.run_grid(generous, [])
    assert not again["skipped"] and len(again["done"]) == 2 and len(again["failed"]) == 2


def test_grid_resume_keeps_done_jobs_and_runs_the_rest(tmp_path, monkeypatch):
    """A grid in pieces: the first piece's budget holds one job; the resumed piece keeps
    it (its JSON exists: not run again), runs the rest and adds the times up. Without
    --resume the same call starts over (the control)."""
    job = tmp_path / "job.py"
    job.write_text("import sys, time\ntime.sleep(0.3)\n"
                   "open(sys.argv[sys.argv.index('--json') + 1], 'a').write('x\\n')\n")
    monkeypatch.setattr(G, "BENCH", str(job))
    args = G.argparse.Namespace(out=str(tmp_path), budget_min=0.2 / 60, margin=1.1,
                                shapes="2x2,4x1", rates="1000", seeds="0",
                                no_calibrate=True, extra_rates="", verbose=False,
                                resume=True)
    first = G.run_grid(args, [])
    assert [j["shape"] for j in first["done"]] == ["2x2"] and first["skipped"], first
    more = G.argparse.Namespace(**{**vars(args), "budget_min": 10.0})
    second = G.run_grid(more, [])
    assert [j["shape"] for j in second["done"]] == ["2x2", "4x1"], second
    assert second["pieces"] == 2 and second["grid_s"] > first["grid_s"], second
    part = tmp_path / "tta_gpt_parts" / "2x2_1000_0.json"
    assert part.read_text() == "x\n", "the done job ran again on --resume"
    fresh = G.run_grid(G.argparse.Namespace(**{**vars(more), "resume": False}), [])
    assert len(fresh["done"]) == 2 and part.read_text() == "x\nx\n", fresh


def test_report_prints_a_panel_without_the_synchronous_run(capsys):
    """An exploration run without gradient_allreduce (--algorithms local_sgd,diloco ...)
    has no target: the console report says so instead of raising (it did: TypeError)."""
    from bench_time_to_accuracy_report import report, summarize
    with open(SMOKE) as fh:
        result = json.load(fh)
    for panel in result["panels"].values():
        for run in panel["runs"]:
            run["contenders"].pop("gradient_allreduce")
            B.score(run, result["tolerance"], result["config"]["loss_tolerance"])
        panel["summary"] = summarize(panel["runs"])
    report(result)
    out = capsys.readouterr().out
    assert "none (no gradient_allreduce run)" in out and "diloco" in out, out


def test_splice_with_another_marker_leaves_the_first_section(tmp_path):
    readme = tmp_path / "README.md"
    b2, e2 = G.markers("tta-gpt-2x1")
    readme.write_text(f"{G.BEGIN}\nfirst\n{G.END}\n{b2}\nold\n{e2}\n")
    G.splice(str(readme), "second\n", "tta-gpt-2x1")
    assert readme.read_text() == f"{G.BEGIN}\nfirst\n{G.END}\n{b2}\nsecond\n{e2}\n"
    (tmp_path / "other.md").write_text(f"{G.BEGIN}\nx\n{G.END}\n")
    with pytest.raises(SystemExit, match="tta-gpt-2x1:begin"):
        G.splice(str(tmp_path / "other.md"), "y", "tta-gpt-2x1")
