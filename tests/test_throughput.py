"""The one definition of a run's throughput figures (analysis/throughput.py) and the step times they are taken from
(rank 0's, from the event log, matched to the log's rows by analysis.mfu.with_event_times)."""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

from analysis import throughput as tp
from analysis.mfu import with_event_times


def test_steady_steps_drop_each_attempts_warm_up_and_rates_derive_from_the_one_step_time():
    attempts = [[9.0, 5.0, 1.0, 2.0, 3.0], [7.0, 6.0, 4.0]]  # the first 2 of each are warm-up
    f = tp.figures(attempts, tokens_per_step=512, tflop_per_gpu_step=0.01, peak=1e12)
    assert (f.steps, f.step_time_s) == (4, 2.5)  # the median of 1, 2, 3, 4
    assert f.tokens_per_s == 512 / 2.5 and f.tflops_per_gpu == 0.01 / 2.5 and f.mfu == pytest.approx(0.004)
    assert tp.figures([[3.0, 2.0]]).step_time_s == 2.5  # no steady step at all: every logged step
    assert tp.figures([]).step_time_s is None and tp.line(tp.figures([])).startswith("step time n/a")
    assert tp.figures([[1.0, 1.0, 2.0]], mfu_seconds=0.8).mfu == 0.4  # only the job's own MFU known


def test_attempts_are_delimited_by_rank_0s_job_start():
    ev = [{"event": "job_start", "rank": 0}, {"event": "iteration", "rank": 0, "seconds": 1.0},
          {"event": "job_start", "rank": 1}, {"event": "iteration", "rank": 0, "seconds": 2.0},
          {"event": "job_start", "rank": 0, "restart_count": 0},  # a second local launch: restart count 0 again
          {"event": "iteration", "rank": 0, "seconds": 3.0}, {"event": "iteration", "seconds": "x"}]
    assert tp.attempts_from_events(ev) == [[1.0, 2.0], [3.0]]


def test_each_figure_is_written_one_way():
    f = tp.RunFigures(6, 0.35441, 1444.6, 0.00244975, 0.41234)
    assert tp.line(f) == "step time 0.354 s, 1,445 tokens/s, 0.00245 TFLOP/s/GPU, MFU 41.2%"
    assert tp.step_time_text(12.345) == "12.3 s" and tp.tflops_text(412.3) == "412 TFLOP/s/GPU"
    assert tp.pct_text(None) == "n/a"


def test_the_log_rows_take_rank_0s_time_of_the_same_step_and_occurrence():
    it = pd.DataFrame({"iteration": [1, 2, 3, 2, 3, 4], "elapsed_ms": [100.0] * 6,
                       "timestamp": pd.to_datetime(["2026-01-01 00:00:0%d" % s for s in range(6)])})
    ev = [{"event": "iteration", "rank": 0, "step": k, "seconds": s}
          for k, s in ((1, 0.5), (2, 0.6), (3, 0.7), (2, 0.8), (3, 0.9))]  # step 4: not in the event log
    out = with_event_times(it, ev)
    assert out["elapsed_ms"].tolist() == [500.0, 600.0, 700.0, 800.0, 900.0, 100.0]
    twice = with_event_times(pd.concat([it, it.iloc[[0]]], ignore_index=True), ev)  # two ranks logged step 1
    assert twice["elapsed_ms"].tolist()[:1] == [100.0] and twice["elapsed_ms"].tolist()[1] == 600.0
    assert with_event_times(it, []) is it


def test_the_module_imports_neither_torch_nor_pandas():
    import subprocess

    code = "import sys, analysis.throughput; print(sorted(m for m in ('torch', 'pandas', 'numpy') if m in sys.modules))"
    repo = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo).stdout
    assert out.strip() == "[]"


def test_the_reports_tables_hold_the_run_figures_steps_even_one_the_last_ranks_log_lost(tmp_path):
    """The recorded Slurm run (tests/fixtures/slurm_run, TP2 x DP2): step 13 of the second attempt is in rank 0's
    event log but not in the last rank's log (killed before it printed). The run figure, the per-layout row and the
    per-attempt rows are over the same 17 steady steps."""
    import json

    from analysis.report import main as report_main

    fixture = Path(__file__).resolve().parent / "fixtures" / "slurm_run"
    assert report_main([str(fixture), "--out", str(tmp_path)]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())["runs"]["slurm_run"]
    fig = tp.RunFigures(**s["throughput"])
    assert (fig.steps, fig.source) == (17, "event log")
    per_attempt = pd.DataFrame(s["mfu_by_attempt"])
    assert per_attempt["steps"].tolist() == [4, 5, 8] and per_attempt["last_step"].tolist() == [6, 13, 20]
    layout = pd.read_csv(tmp_path / "iterations.csv")  # the log's rows: step 13 once (attempt 2's)
    assert (layout["iteration"] == 13).sum() == 1
    md = (tmp_path / "report.md").read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| tp2-pp1-dp2 |"))
    assert row.split(" | ")[1:3] == ["17", tp.tokens_text(fig.tokens_per_s).removesuffix(" tokens/s")]
