"""benchmarks/cost_model.py on the committed shaped GPT runs: the byte terms of diloco,
streaming_diloco and powersgd within 5% of the measured bus bytes (negative control: a
wrong wire factor is rejected), calibration and validation inverse to each other for
every modelled contender, and the GPT recommendation produced."""
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
import cost_model as CM  # noqa: E402

RESULTS = os.path.join(HERE, "..", "benchmarks", "results")
RUNS = [os.path.join(RESULTS, f) for f in ("tta_gpt_tiny_2x2_smoke.json", "bytes_gpt_2x1.json",
                                           "bytes_gpt_2x1_streaming.json",
                                           "bytes_gpt_4x1.json")]
NEW = ("diloco", "streaming_diloco", "powersgd")


def _big(rows):
    """Rows of the 1 M-parameter runs (the tiny model's chunk padding is not modelled)."""
    return [r for r in rows if r["params"] > 1e6 and r["contender"] in NEW]


def test_bytes_of_the_new_algorithms_match_the_runs():
    shaped = CM._load(RUNS, shaped=True)
    rows = _big(CM.validate_bytes(shaped))
    assert {r["contender"] for r in rows} == set(NEW), rows
    bad = [r for r in rows if abs(r["error"]) > 0.05]
    assert not bad, bad
    wire = dict(CM.WIRE)
    try:  # negative control: int4 modelled with int8's wire bytes
        CM.WIRE["int4"] = wire["int8"]
        wrong = [r for r in _big(CM.validate_bytes(shaped))
                 if r["contender"] == "streaming_diloco"]
        assert wrong and all(abs(r["error"]) > 0.05 for r in wrong), wrong
    finally:
        CM.WIRE.update(wire)


def test_calibration_and_validation_are_inverse_for_every_contender():
    """Each shaped panel calibrates itself: every prediction is the measurement."""
    rows = []
    for key, panel in CM._load(RUNS, shaped=True).items():
        rows += CM.validate({key: panel}, CM.calibrate({key: panel}))
    assert set(NEW) <= {r["contender"] for r in rows}
    assert all(abs(r["error"]) < 1e-9 for r in rows), rows
    for r in rows:   # streaming_diloco's exchange may hide behind the next step
        if r["contender"] in NEW and r["contender"] != "streaming_diloco":
            assert r["comm_s"] > 0, r
    for key, panel in CM._load(RUNS, shaped=True).items():   # ...but not without compute
        run = panel["runs"][0]
        if "streaming_diloco" in run["contenders"]:
            c, s = CM.cluster_of(panel, run), CM.model_bytes(run)
            row = run["contenders"]["streaming_diloco"]
            assert CM.row_comm("streaming_diloco", c, s, row) > 0, key
            assert CM.row_comm("streaming_diloco", c, s, row, compute_s=10.0) == 0, key


def test_gpt_recommendation(tmp_path, capsys):
    out = tmp_path / "cm.json"
    assert CM.main(["--validate", ",".join(RUNS), "--workload", "gpt", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "step-time validation is skipped" in text
    data = json.loads(out.read_text())
    assert data["scale"]["model_bytes"] == pytest.approx(4 * 1049184)
    assert len(data["recommendation"]) == 32
    streaming = [r for r in data["predictions"] if r["contender"] == "streaming_diloco"]
    diloco = {(r["inter_gbit"], r["ranks"]): r for r in data["predictions"]
              if r["contender"] == "diloco"}
    for r in streaming:  # peak per step: 1/F of DiLoCo's, times the int4 wire factor
        d = diloco[(r["inter_gbit"], r["ranks"])]
        assert r["peak_bytes_per_step"] == pytest.approx(d["peak_bytes_per_step"] * CM.WIRE["int4"] / 2)


def test_gathered_algorithms_message_ratio_matches_their_layouts():
    """The cost model's closed forms of sparseloco, muloco (int2) and demo against the
    algorithms' own layout code on shapes the closed forms assume (C | numel; s x s
    chunks), the bench worker's exact figure on a real model, and the allgather's bus
    ratio; negative control: sparseloco's message modelled with 4-bit codes is rejected."""
    import torch

    from bench_time_to_accuracy_worker import message_bytes
    from commlib.algorithms.demo import bytes_per_step
    from commlib.algorithms.sparseloco import layout
    from cost_model_formulas import DEFAULTS, bytes_ratio, gathered_ratio, message_ratio

    a = dict(DEFAULTS["sparseloco"])
    numel = 4096 * 37
    exact = layout([numel], a["chunk_size"], a["density"], a["value_bits"]).nbytes
    assert message_ratio("sparseloco", a) * 4 * numel == pytest.approx(exact, rel=1e-12)
    wrong = message_ratio("sparseloco", {**a, "value_bits": 4}) * 4 * numel
    assert abs(wrong / exact - 1) > 0.05
    d = dict(DEFAULTS["demo"])
    shapes = [(64 * 5, 64 * 3), (128, 64 * 7)]
    exact = bytes_per_step(shapes, d["chunk_size"], d["topk"], 4)
    assert message_ratio("demo", d) * 4 * sum(r * c for r, c in shapes) == \
        pytest.approx(exact, rel=1e-12)
    m = DEFAULTS["muloco"]
    assert message_ratio("muloco", m) == 1 / 16
    # the worker's exact figure on a real model: within 3% of the closed forms
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024, bias=False),
                                torch.nn.Linear(1024, 256, bias=False))
    params = sum(p.numel() for p in model.parameters())
    for name, kw in (("sparseloco", {}), ("muloco", {}), ("demo", {})):
        got = message_bytes(name, model, kw) / (4 * params)
        assert got == pytest.approx(message_ratio(name, DEFAULTS[name]), rel=0.03), name
    # bus bytes of an allgather against an allreduce's: n M / 2 S, per exchange interval
    assert gathered_ratio("sparseloco", a, 4) == pytest.approx(
        (4 * message_ratio("sparseloco", a) / 2 / 15, 4 * message_ratio("sparseloco", a) / 2))
    assert bytes_ratio("demo", None) is None and bytes_ratio("demo", None, ranks=2)[0] == \
        pytest.approx(message_ratio("demo", d))
