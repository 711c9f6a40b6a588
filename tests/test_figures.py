"""One source for each reported figure (analysis/figures.py): tokens/s, the layout label and the attempt count are
the same in ``launch/status.py``, the report (report.md, its per-attempt table) and ``summary.json``, on the
recorded real run (``tests/fixtures/slurm_run``) and on the same run as a newer worker records it."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from analysis import figures
from analysis.document import num
from analysis.report import main as report_main
from launch import status
from launch.run_state import gather

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "slurm_run"


def _no_slurm(argv, **kw):
    return subprocess.CompletedProcess(argv, 1, "", "slurm_load_jobs error: Invalid job id specified\n")


def _run(tmp_path: Path, label: str | None = None, local_relaunch: bool = False) -> Path:
    d = tmp_path / "run"
    shutil.copytree(FIXTURE, d)
    lines = (d / "events.jsonl").read_text().splitlines()
    out = []
    for line in lines:
        e = json.loads(line)
        if e.get("event") == "job_start" and label:
            e["layout_label"] = label
        out.append(json.dumps(e))
    if local_relaunch:  # a second local launch: restart count 0 again, no job id
        starts = [json.loads(x) for x in out if json.loads(x).get("event") == "job_start"]
        again = {**starts[-1], "job_id": None, "restart_count": 0, "time": starts[-1]["time"] + 3600}
        out.append(json.dumps(again))
    (d / "events.jsonl").write_text("\n".join(out) + "\n")
    return d


@pytest.mark.parametrize("label,local_relaunch", [(None, False), ("tp2-pp1-nodo-dp2", True)])
def test_status_report_and_summary_json_agree(tmp_path, label, local_relaunch):
    run = _run(tmp_path, label, local_relaunch)
    st = gather(run, runner=_no_slurm)
    out = tmp_path / "report"
    assert report_main([str(run), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())["runs"]
    [(name, s)] = summary.items()
    md = (out / "report.md").read_text()
    text = status.format_state(st)

    want_layout = label or "tp2-pp1-dp2"
    assert st.layout == s["layout"] == want_layout
    assert f"layout: {want_layout}" in md
    assert want_layout in text

    assert st.attempts == s["attempts"] == (4 if local_relaunch else 3)
    assert f"attempts: {s['attempts']};" in md

    assert st.tokens_per_s is not None and st.tokens_per_s == pytest.approx(s["tokens_per_s"], rel=1e-12)
    assert f"{num(s['tokens_per_s'])} tokens/s" in md
    assert f"{st.tokens_per_s:,.0f} tokens/s" in text
    if not local_relaunch:  # one layout, steady steps: the per-attempt table's medians bracket the run's
        per_attempt = pd.DataFrame(s["mfu_by_attempt"])["tokens_per_s"]
        assert per_attempt.min() <= s["tokens_per_s"] <= per_attempt.max()
        assert set(pd.DataFrame(s["mfu_by_attempt"])["layout"]) == {want_layout}


def test_layout_of_prefers_the_workers_label():
    sizes = {"tp": 2, "pp": 1, "vpp": None, "dp": 2, "cp": 1, "ep": 1}
    assert figures.layout_of({"layout": sizes}) == "tp2-pp1-dp2"
    assert figures.layout_of({"layout": sizes, "layout_label": "tp2-pp1-nodo-dp2"}) == "tp2-pp1-nodo-dp2"
    assert figures.attempt_count([{"event": "job_start", "rank": 0}, {"event": "job_start", "rank": 0},
                                  {"event": "iteration"}]) == 2
