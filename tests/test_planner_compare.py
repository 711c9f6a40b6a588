"""python -m launch.planner.compare: estimated vs measured step time and MFU per sweep member."""
from __future__ import annotations

import json

import pytest

from launch.planner.compare import compare, main

LINE = ("[2026-11-29 10:00:{sec:02d}.000000] iteration {it:8d}/      20 | consumed samples: {cs} | "
        "elapsed time per iteration (ms): {ms:.1f} | throughput per GPU (TFLOP/s/GPU): 400.0 | "
        "learning rate: 3.000000E-04 | global batch size: 8 | lm loss: 5.5E+00 | loss scale: 1.0 | "
        "grad norm: 1.234 | number of skipped iterations: 0 | number of nan iterations: 0 |\n")


def _registry(tmp_path):
    run = tmp_path / "runs" / "sweep_1"
    (run / "logs").mkdir(parents=True)
    with open(run / "logs" / "1001_0.out", "w") as fh:
        for it in range(1, 11):
            fh.write(LINE.format(sec=it, it=it, cs=8 * it, ms=5000.0 if it <= 2 else 2000.0))
    entries = [
        {"job_id": "1001", "run_dir": str(run), "layout": "custom", "status": "submitted",
         "estimate": {"layout": "tp8-pp4-sp", "step_time_s": 1.8, "mfu": 0.45}},
        {"job_id": None, "run_dir": str(tmp_path / "runs" / "sweep_2"), "layout": "custom", "status": "skipped",
         "reasons": ["cluster.nodes: world size is not divisible"]},
        {"job_id": "1003", "run_dir": str(tmp_path / "runs" / "none_yet"), "layout": "custom", "status": "submitted",
         "estimate": {"layout": "tp4-pp8", "step_time_s": 2.0, "mfu": 0.4}},
    ]
    path = tmp_path / "sweeps" / "s.jsonl"
    path.parent.mkdir()
    path.write_text("\n".join(json.dumps(e) for e in entries) + "\n{torn line")
    return path


def test_measured_beside_estimated(tmp_path):
    df = compare(_registry(tmp_path))
    assert list(df["layout"]) == ["tp8-pp4-sp", "custom", "tp4-pp8"]
    first = df.iloc[0]
    assert first["meas_step_s"] == pytest.approx(2.0)  # median after the warm-up iterations
    assert first["meas_mfu"] == pytest.approx(0.45 * 1.8 / 2.0)  # no MFU printed: scaled by step time
    assert first["est_over_meas"] == pytest.approx(0.9)
    assert first["iterations"] == 10
    assert "not divisible" in df.iloc[1]["reasons"]
    assert df.iloc[2]["iterations"] == 0  # submitted, no log yet


def test_cli(tmp_path):
    lines: list[str] = []
    assert main([str(_registry(tmp_path))], out=lines.append) == 0
    assert "tp8-pp4-sp" in lines[0]
    assert "median |error| 10.0%" in lines[1] and "within the planner's stated error" in lines[1]
    assert main([str(tmp_path / "missing.jsonl")], out=lines.append) == 2


def test_calibration_line_asks_for_a_refit_beyond_the_stated_error():
    import pandas as pd

    from launch.planner.compare import calibration_line
    assert "refit" in calibration_line(pd.DataFrame({"est_over_meas": [0.7, 0.75, 1.0]}))
    assert calibration_line(pd.DataFrame({"est_over_meas": [None]})) == ""
