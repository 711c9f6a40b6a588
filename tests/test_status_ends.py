"""``launch/status.py`` at the end of a slice or a run, on the recorded fixture run with Slurm faked at the
subprocess boundary: a drained run says stopped and how to continue, live sacct beats a saved dump, a run with
no events yet shows no analysis error, attempts come from Slurm and the event log together, and the slices left
count the running slice's own time."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from launch import status
from launch.run_state import gather

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "slurm_run"
HEADER = ("JobID|JobIDRaw|JobName|Partition|State|ExitCode|DerivedExitCode|NNodes|NodeList|AllocTRES|Submit|Eligible|"
          "Start|End|Elapsed|Timelimit|Reason")


def row(job: str, state: str, elapsed: str = "00:01:00") -> str:
    return (f"{job}|{job}|x|debug|{state}|0:0|0:0|2|stn[1-2]|billing=8,cpu=8,node=2|2026-11-29T10:42:31|"
            f"2026-11-29T10:42:31|2026-11-29T10:42:32|2026-11-29T10:43:32|{elapsed}|00:10:00|None")


class Slurm:
    """squeue/sacct for the run's jobs: ``queue`` (None: not listed), ``final`` (sacct -X), ``dump`` (sacct -D,
    None: sacct unavailable)."""

    def __init__(self, queue=None, final="", dump=None):
        self.queue, self.final, self.dump = queue, final, dump

    def __call__(self, argv, **kw):
        if argv[0] == "squeue":
            if self.queue is None:
                return subprocess.CompletedProcess(argv, 1, "", "slurm_load_jobs error: Invalid job id specified\n")
            return subprocess.CompletedProcess(argv, 0, self.queue + "\n", "")
        if argv[0] == "sacct" and "-D" in argv:
            if self.dump is None:
                return subprocess.CompletedProcess(argv, 1, "", "sacct: error: Slurm accounting storage is disabled")
            return subprocess.CompletedProcess(argv, 0, self.dump, "")
        if argv[0] == "sacct":
            return subprocess.CompletedProcess(argv, 0, self.final + "\n", "")
        raise AssertionError(argv)


def new_run(tmp_path: Path, job: str = "9001", events: list | None = None) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    shutil.copy(FIXTURE / "config.yaml", d)
    (d / "submissions.jsonl").write_text(json.dumps({"job_id": job, "time": 1.0, "script": "x"}) + "\n")
    if events:
        (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return d


def ev(event: str, restart: int = 0, job: str = "9001", t: float = 1.0, **kw) -> dict:
    return {"time": t, "event": event, "job_id": job, "restart_count": restart, "rank": 0, **kw}


def test_a_drained_run_is_stopped_with_the_step_and_how_to_continue(tmp_path):
    d = new_run(tmp_path, events=[ev("job_start", world_size=4), ev("iteration", step=12, seconds=1.0),
                                  ev("stop", reason="user_stop", requeue=False, step=12),
                                  ev("exit", reason="stopped", code=0, step=12)])
    st = gather(d, runner=Slurm(final="9001|COMPLETED|0:0", dump=HEADER + "\n" + row("9001", "COMPLETED")))
    assert st.state == "stopped" and st.finished
    assert st.reason.startswith("user_stop at step 12; continue with: the same python launch/pretrain.py command")
    text = status.format_state(st)
    assert "state      stopped (user_stop at step 12; continue with:" in text
    assert "ETA" not in text and "worker logged no completion" not in text


def test_a_cancelled_stop_names_the_cancel(tmp_path):
    d = new_run(tmp_path, events=[ev("job_start"), ev("stop", reason="user_cancel", requeue=False, step=7),
                                  ev("exit", reason="stopped", code=0, step=7)])
    st = gather(d, runner=Slurm(final="9001|CANCELLED by 0|0:15", dump=None))
    assert (st.state, st.reason.split(";")[0]) == ("stopped", "user_cancel at step 7")


def test_a_slice_that_ended_timeout_without_a_word_says_so_and_how_to_continue(tmp_path):
    d = new_run(tmp_path, events=[ev("job_start"), ev("iteration", step=32, seconds=1.0)])
    st = gather(d, runner=Slurm(final="9001|TIMEOUT|0:0", dump=HEADER + "\n" + row("9001", "TIMEOUT")))
    assert st.state == "timeout"
    assert "ran out of time (run.time_limit_min=" in st.reason and "nothing requeued it" in st.reason
    assert "continue with: the same python launch/pretrain.py command" in st.reason


def test_live_sacct_first_and_a_saved_dump_only_when_sacct_is_unavailable(tmp_path):
    d = new_run(tmp_path, events=[ev("job_start", world_size=4), ev("iteration", step=3, seconds=1.0)])
    (d / "sacct.txt").write_text(HEADER + "\n" + row("9001", "RUNNING", "00:10:00") + "\n")  # stale: 10 min
    live = HEADER + "\n" + row("9001", "RUNNING", "00:20:00") + "\n"
    st = gather(d, runner=Slurm(queue="9001|RUNNING|None", dump=live))
    assert st.gpu_hours == pytest.approx(4 * 20 / 60) and st.gpu_hours_source == "sacct"
    assert not st.warnings
    st = gather(d, runner=Slurm(queue="9001|RUNNING|None", dump=None))
    assert st.gpu_hours == pytest.approx(4 * 10 / 60)
    assert any("sacct is unavailable" in w and "saved sacct dump" in w for w in st.warnings)


def test_a_run_with_no_events_yet_has_no_analysis_warning(tmp_path):
    d = new_run(tmp_path)
    (d / "logs").mkdir()
    (d / "logs" / "9001_0.out").write_text("importing torch\n")
    st = gather(d, runner=Slurm(queue="9001|RUNNING|None", dump=HEADER + "\n" + row("9001", "RUNNING")))
    assert st.state == "running" and st.warnings == []
    assert st.attempts == 1  # Slurm's running allocation, before the worker wrote its first event
    assert "WARNING" not in status.format_state(st)


def test_attempts_from_slurm_and_the_event_log_together(tmp_path):
    # three allocations in sacct -D; the first was killed before its job_start, the event log has the other two
    d = new_run(tmp_path, events=[ev("job_start", 1), ev("job_start", 2)])
    dump = "\n".join([HEADER, row("9001", "REQUEUED"), row("9001", "NODE_FAIL"), row("9001", "RUNNING")]) + "\n"
    st = gather(d, runner=Slurm(queue="9001|RUNNING|None", dump=dump))
    assert st.attempts == 3


def test_a_pending_allocation_is_no_attempt(tmp_path):
    # sacct -D lists a job that waits in the queue (Start Unknown); a requeued one waits again after one attempt
    pending = row("9001", "PENDING").replace("2026-11-29T10:42:32|2026-11-29T10:43:32", "Unknown|Unknown")
    d = new_run(tmp_path, events=[])
    st = gather(d, runner=Slurm(queue="9001|PENDING|BeginTime", dump=HEADER + "\n" + pending + "\n"))
    assert st.attempts == 0
    (tmp_path / "requeued").mkdir()
    d2 = new_run(tmp_path / "requeued", events=[ev("job_start", 0)])
    dump = "\n".join([HEADER, row("9001", "REQUEUED"), pending]) + "\n"
    st = gather(d2, runner=Slurm(queue="9001|PENDING|BeginTime", dump=dump))
    assert st.attempts == 1


def test_no_more_slice_when_the_running_slice_can_finish(tmp_path):
    now = 10_000.0
    d = new_run(tmp_path, events=[ev("job_start", t=now - 60), ev("iteration", step=10, seconds=1.0, t=now)])
    cfg = d / "config.yaml"
    text = cfg.read_text()
    assert "train_iters: 20" in text
    cfg.write_text(text.replace("train_iters: 20", "train_iters: 100"))  # 90 steps x 1 s left, 10-min slices
    st = gather(d, runner=Slurm(queue="9001|RUNNING|None", dump=None), clock=lambda: now)
    assert st.eta_s == pytest.approx(90.0) and st.slices_left == 0
    assert "more slice" not in status.format_state(st)
    st = gather(d, runner=Slurm(queue="9001|PENDING|Priority", dump=None), clock=lambda: now)
    assert st.slices_left == 1  # not running: the next slice does it
