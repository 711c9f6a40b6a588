"""A slice that ended TIMEOUT without its stop checkpoint, and nothing requeued it: the report says so in one line
and how to continue, with the same rule (analysis/slice_end.py) and wording as status.py. On the recorded
fixture run (made by real Slurm), its last attempt turned into such a slice: the sacct dump's final state TIMEOUT,
the attempt's events cut after step 17 (killed at the limit before any stop or exit event)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from analysis.document import md
from analysis.report import main
from analysis.slice_end import attempt_events, timeout_line, unanswered_timeout
from launch.run_state import gather

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "slurm_run"
LINE = ("the slice ran out of time (run.time_limit_min=10) before a stop checkpoint, and nothing requeued it; "
        "continue with: the same python launch/pretrain.py command (run.name=fixture); it resumes from its newest "
        "verified checkpoint")


def events_of(d: Path) -> list[dict]:
    return [json.loads(x) for x in (d / "events.jsonl").read_text().splitlines() if x.strip()]


def write_events(d: Path, events: list[dict]) -> None:
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def timed_out_run(tmp_path: Path, *, cut_after_step: int = 17, sacct_last: str = "TIMEOUT") -> Path:
    """The fixture run whose third attempt (job 8700, restart 2) was killed at its time limit after ``step``."""
    d = tmp_path / "fixture"
    shutil.copytree(FIXTURE, d)
    keep = [e for e in events_of(d) if not (e.get("restart_count") == 2 and e.get("event") != "job_start"
                                            and (e.get("step") is None or e["step"] > cut_after_step)
                                            and e.get("event") != "resume")]
    write_events(d, keep)
    lines = (d / "sacct.txt").read_text().splitlines()
    last_alloc = max(i for i, x in enumerate(lines) if x.startswith("8700|"))
    lines[last_alloc] = lines[last_alloc].replace("|COMPLETED|", f"|{sacct_last}|", 1)
    (d / "sacct.txt").write_text("\n".join(lines) + "\n")
    return d


def report(d: Path, tmp_path: Path) -> tuple[str, str, dict]:
    out = tmp_path / "out"
    assert main([str(d), "--out", str(out)]) == 0
    return ((out / "report.md").read_text(), (out / "report.html").read_text(),
            json.loads((out / "summary.json").read_text())["runs"]["fixture"])


def test_the_report_says_a_slice_ended_timeout_unanswered_and_how_to_continue(tmp_path):
    text, html, s = report(timed_out_run(tmp_path), tmp_path)
    assert s["ended_unanswered_timeout"] == LINE
    assert text.count(md(LINE)) == 1 and md(f"ended: {LINE}") in text  # Markdown-escaped, once
    assert f"<li>ended: {LINE}</li>" in html


def test_the_report_of_the_recorded_run_as_it_ended_has_no_such_line(tmp_path):
    d = tmp_path / "fixture"
    shutil.copytree(FIXTURE, d)
    text, html, s = report(d, tmp_path)  # completed: the worker's exit says so
    assert s["ended_unanswered_timeout"] is None
    assert "ran out of time" not in text and "ran out of time" not in html


def test_a_slice_that_saved_and_requeued_at_its_limit_has_no_such_line(tmp_path):
    d = timed_out_run(tmp_path)
    write_events(d, events_of(d) + [
        {"time": 1795949150.0, "event": "stop", "job_id": "8700", "restart_count": 2, "rank": 0,
         "reason": "time_limit", "step": 17},
        {"time": 1795949150.1, "event": "exit", "job_id": "8700", "restart_count": 2, "rank": 0,
         "reason": "requeue", "code": 42, "step": 17}])
    assert report(d, tmp_path)[2]["ended_unanswered_timeout"] is None


def test_a_later_job_that_continued_the_run_has_no_such_line(tmp_path):
    d = timed_out_run(tmp_path)  # e.g. a resubmission, or a run.dependency_chain continuation not in the dump
    write_events(d, events_of(d) + [{"time": 1795949300.0, "event": "job_start", "job_id": "8701",
                                     "restart_count": 0, "rank": 0, "world_size": 4}])
    assert report(d, tmp_path)[2]["ended_unanswered_timeout"] is None


def test_an_earlier_attempts_requeue_does_not_hide_the_last_attempts_timeout(tmp_path):
    # attempt 1 of job 8700 (the one before the slice) ended 'exit requeue': the rule reads the last attempt's
    # events only, so that exit does not answer for the slice after it
    d = timed_out_run(tmp_path)
    write_events(d, [dict(e, reason="requeue", code=42) if e.get("event") == "exit" and e.get("restart_count") == 1
                     else e for e in events_of(d)])
    assert report(d, tmp_path)[2]["ended_unanswered_timeout"] == LINE


def test_a_dump_without_d_reads_the_newest_attempt_the_events_carry(tmp_path):
    d = timed_out_run(tmp_path)
    lines = (d / "sacct.txt").read_text().splitlines()
    (d / "sacct.txt").write_text("\n".join([lines[0]] + lines[-3:]) + "\n")  # sacct -X: the job's final row only
    assert report(d, tmp_path)[2]["ended_unanswered_timeout"] == LINE


@pytest.mark.parametrize("state,answered", [("TIMEOUT", False), ("DEADLINE", False), ("TIMEOUT", True),
                                            ("NODE_FAIL", False), ("COMPLETED", False)])
def test_the_rule(state, answered):
    events = [{"event": "job_start", "job_id": "5", "restart_count": 0},
              {"event": "exit", "job_id": "5", "restart_count": 0, "reason": "requeue"},
              {"event": "job_start", "job_id": "5", "restart_count": 1}]
    if answered:
        events.append({"event": "exit", "job_id": "5", "restart_count": 1, "reason": "stopped"})
    mine = attempt_events(events, "5")
    assert [e.get("restart_count") for e in mine] == [1] * len(mine)
    assert unanswered_timeout(state, mine) is (state in ("TIMEOUT", "DEADLINE") and not answered)
    assert unanswered_timeout(state, attempt_events(events, "5", attempt=0)) is False


def test_status_and_the_report_say_the_same_line(tmp_path):
    d = timed_out_run(tmp_path)
    (d / "submissions.jsonl").write_text(json.dumps({"job_id": "8700", "time": 1.0, "script": "x"}) + "\n")
    dump = (d / "sacct.txt").read_text()

    def runner(argv, **kw):
        import subprocess

        if argv[0] == "squeue":
            return subprocess.CompletedProcess(argv, 1, "", "slurm_load_jobs error: Invalid job id specified\n")
        if argv[0] == "sacct" and "-D" in argv:
            return subprocess.CompletedProcess(argv, 0, dump, "")
        if argv[0] == "sacct":
            return subprocess.CompletedProcess(argv, 0, "8700|TIMEOUT|0:0\n", "")
        raise AssertionError(argv)

    st = gather(d, runner=runner)
    assert st.state == "timeout"
    # status names the newest verified checkpoint on disk when there is one; this copy has none: the same line
    assert st.checkpoint_step is None and st.reason == LINE == timeout_line(10, "fixture", None)
