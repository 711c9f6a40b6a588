"""How each interruption was recovered (in the job or requeued) and the phases of its time to resume
(analysis/recovery_time.py): exact arithmetic on a hand-made event log, then the real event logs of the local
Slurm cluster (tests/fixtures/slurm_run: two requeues; tests/fixtures/slurm_injob: three in-job relaunches)."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from analysis import recovery_time
from analysis.interruptions import build_attempts, interruptions
from analysis.load import load_paths
from analysis.parse_events import parse_events_text
from analysis.report import main

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _log(*events: dict) -> pd.DataFrame:
    return parse_events_text("\n".join(json.dumps({"job_id": "9", "rank": 0, **e}) for e in events))[0]


def _table(ev: pd.DataFrame, sacct=None) -> pd.DataFrame:
    att, _ = build_attempts(pd.DataFrame(columns=["source", "job_id", "offset", "seq", "iteration", "timestamp",
                                                  "elapsed_ms", "nonfinite", "train_iters"]),
                            events=ev, sacct=sacct, gpus=4)
    return recovery_time.add_recovery(interruptions(att), att, ev)


def _step(restart: int, t0: float, *, last: float) -> list[dict]:
    """A step that starts at t0, loads a checkpoint (2 s, done at t0 + 10), trains from t0 + 13 to ``last``."""
    return [{"time": t0, "event": "job_start", "restart_count": restart},
            {"time": t0 + 10, "event": "resume", "restart_count": restart, "step": 5, "seconds": 2.0},
            {"time": t0 + 13, "event": "iteration", "restart_count": restart, "step": 6},
            {"time": last, "event": "iteration", "restart_count": restart, "step": 7}]


def test_a_relaunch_in_the_job_is_split_into_its_phases_with_no_queue_wait() -> None:
    ev = _log(*_step(0, 1000.0, last=1020.0),
              {"time": 1021.5, "event": "stop", "restart_count": 0, "reason": "crash", "code": 1},
              {"time": 1030.0, "event": "in_job_restart", "restart_count": 0, "cause": "crash", "next_restart_count": 1,
               "phases": {"detection_s": 1.5, "teardown_s": 6.0, "queue_wait_s": 0.0, "health_check_s": 2.0}},
              *_step(1, 1040.0, last=1060.0))
    (row,) = _table(ev).to_dict("records")
    assert (row["attempt"], row["cause"], row["recovery"]) == (0, "crash", recovery_time.IN_JOB)
    # detection, teardown, health check: recovery/injob.py's own measures; start-up: the relaunch (1030) to the
    # load's start (1050 - 2); the load; the first step (1053) after it; the total: last progress (1020) to 1053
    assert {k: row[k] for k in recovery_time.PHASES + ["time_to_resume_s"]} == {
        "detection_s": 1.5, "teardown_s": 6.0, "queue_wait_s": 0.0, "health_check_s": 2.0, "startup_s": 18.0,
        "checkpoint_load_s": 2.0, "first_step_s": 3.0, "time_to_resume_s": 33.0}


def test_a_requeue_takes_its_phases_from_the_events_and_the_allocations() -> None:
    ev = _log(*_step(0, 1000.0, last=1020.0),
              {"time": 1024.0, "event": "hang", "restart_count": 0},
              {"time": 1025.0, "event": "stop", "restart_count": 0, "reason": "hang"},
              *_step(1, 1100.0, last=1120.0))
    ts = lambda t: pd.Timestamp(t, unit="s", tz="UTC").tz_convert(recovery_time._local_tz()).tz_localize(None)
    sacct = pd.DataFrame({"job": ["9", "9"], "attempt": [0, 1], "is_alloc": [True, True],
                          "submit": [ts(990.0), ts(1030.0)], "start": [ts(995.0), ts(1090.0)],
                          "end": [ts(1030.0), ts(1125.0)], "state": ["REQUEUED", "COMPLETED"], "gpus": [4, 4]})
    (row,) = _table(ev, sacct).to_dict("records")
    assert (row["cause"], row["recovery"]) == ("hang", recovery_time.REQUEUED)
    assert {k: row[k] for k in recovery_time.PHASES + ["time_to_resume_s"]} == {
        "detection_s": 4.0, "teardown_s": 6.0, "queue_wait_s": 60.0, "health_check_s": 0.0, "startup_s": 18.0,
        "checkpoint_load_s": 2.0, "first_step_s": 3.0, "time_to_resume_s": 93.0}


def test_a_final_stop_is_not_resumed_and_has_no_phases() -> None:
    ev = _log(*_step(0, 1000.0, last=1020.0),
              {"time": 1021.0, "event": "stop", "restart_count": 0, "reason": "budget", "code": 17},
              {"time": 1021.1, "event": "exit", "restart_count": 0, "reason": "budget", "code": 17})
    (row,) = _table(ev).to_dict("records")
    assert row["cause"] == "budget" and row["recovery"] == ""
    assert all(pd.isna(row[k]) for k in recovery_time.PHASES + ["time_to_resume_s"])
    assert recovery_time.summary_line(recovery_time.summary(_table(ev))) == "none resumed"


def test_the_real_requeues_are_requeued_with_a_queue_wait_and_no_health_check(tmp_path: Path) -> None:
    (run,) = load_paths([FIXTURES / "slurm_run"])
    att, _ = build_attempts(run.iterations, run.signatures, run.checkpoints, run.events, run.sacct, gpus=4)
    rows = recovery_time.add_recovery(interruptions(att), att, run.events)
    assert rows["recovery"].tolist() == [recovery_time.REQUEUED] * 2
    assert (rows["queue_wait_s"] > 5).all() and (rows["health_check_s"] == 0).all()
    assert (rows["startup_s"] > 0).all() and (rows["checkpoint_load_s"] > 0).all()
    parts = rows[recovery_time.PHASES].fillna(0).sum(axis=1)
    assert (parts <= rows["time_to_resume_s"] + 1).all(), rows.T
    line = recovery_time.summary_line(recovery_time.summary(rows))
    assert line.startswith("requeued 2 (median ") and "queue wait" in line, line


INJOB = FIXTURES / "slurm_injob"


@pytest.mark.skipif(not (INJOB / "events.jsonl").is_file(), reason="tests/fixtures/slurm_injob/ is not recorded")
def test_the_real_in_job_relaunches_are_recovered_in_job_by_cause_in_the_report(tmp_path: Path) -> None:
    out = tmp_path / "o"
    assert main([str(INJOB), "--out", str(out)]) == 0
    rows = pd.read_csv(out / "interruptions.csv")
    # a crash (same nodes), a lost node (a spare), a hang (the suspect's node avoided): each relaunched in the
    # job; the allocation's COMPLETED belongs to its last step, which finished the run
    assert list(zip(rows["attempt"], rows["cause"], rows["recovery"])) == [
        (0, "crash", recovery_time.IN_JOB), (1, "node_failure", recovery_time.IN_JOB),
        (2, "hang", recovery_time.IN_JOB)], rows.T
    assert rows["slurm_state"].isna().all() and (rows["queue_wait_s"] == 0).all()
    events = [json.loads(x) for x in (INJOB / "events.jsonl").read_text().splitlines()]
    measured = [e["phases"] for e in events if e["event"] == "in_job_restart"]
    assert rows["health_check_s"].tolist() == pytest.approx([m["health_check_s"] for m in measured], abs=1e-3)
    assert (rows["startup_s"] > 0).all() and (rows["checkpoint_load_s"] > 0).all()
    md = (out / "report.md").read_text()
    assert "recovery: recovered in job 3 (median " in md.replace("\\", ""), md
