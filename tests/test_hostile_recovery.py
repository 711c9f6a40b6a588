"""Hostile input on the recovery side: the crash judgement on a missing run directory, a torn event line.
(The fake Slurm stands at the subprocess boundary.)"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fake_slurm import FakeSlurm

from recovery import policy
from recovery.crash import main as crash_main, requeue_after_crash
from recovery.events import EventLog, read_events, read_events_counted


def _env(restart: int) -> dict:
    return {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": str(restart)}


# ---- the crash judgement ------------------------------------------------------------------------

@pytest.mark.parametrize("restart", [0, 3, 50])
def test_a_missing_run_directory_is_refused_for_good_and_never_created(tmp_path: Path, restart: int, capsys) -> None:
    run_dir = tmp_path / "mnt" / "runs" / "gone"
    fake = FakeSlurm()
    code = crash_main([str(run_dir)], env=_env(restart), runner=fake)
    out = capsys.readouterr().out.strip().splitlines()
    assert code == policy.EXIT_STORAGE and code in policy.FINAL_CODES and code != policy.EXIT_REQUEUE
    assert fake.calls == [] and not (tmp_path / "mnt").exists()  # nothing asked of Slurm, nothing created
    assert len(out) == 1 and "does not exist" in out[0] and "not requeued" in out[0]


def test_a_run_directory_that_is_a_file_or_unreadable_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    fake = FakeSlurm()
    assert requeue_after_crash(f, _env(1), fake)[0] == policy.EXIT_STORAGE
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "events.jsonl").mkdir()  # an event log that cannot be read as a file
    code, why = requeue_after_crash(locked, _env(1), fake)
    assert code == policy.EXIT_STORAGE and "cannot be read" in why and fake.calls == []


def _config(run_dir: Path, max_restarts: int) -> None:
    (run_dir / "config.yaml").write_text(f"training:\n  max_restarts: {max_restarts}\nrun:\n  name: r\n")


def test_requeues_stop_at_the_restart_limit_even_without_an_event_log(tmp_path: Path) -> None:
    """Attempts that die before writing any event (no events.jsonl at all) are requeued up to
    training.max_restarts, read from Slurm's restart count, and no further."""
    _config(tmp_path, 3)
    codes = []
    for restart in range(6):
        fake = FakeSlurm()
        code, why = requeue_after_crash(tmp_path, _env(restart), fake)
        codes.append(code)
        if code == policy.EXIT_REQUEUE:
            assert fake.calls == [["scontrol", "requeue", "77"]]
        else:
            assert fake.calls == [] and "training.max_restarts 3" in why
    assert codes == [42, 42, 42, 0, 0, 0]


def test_without_a_readable_config_the_default_restart_limit_applies(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_bytes(b"\x00\xff binary")
    assert requeue_after_crash(tmp_path, _env(19), FakeSlurm())[0] == policy.EXIT_REQUEUE
    code, why = requeue_after_crash(tmp_path, _env(20), FakeSlurm())
    assert code == 0 and "max_restarts 20" in why


# ---- a torn event line ----------------------------------------------------------------------------

def test_a_torn_last_line_does_not_swallow_the_next_event(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, job_id="1", clock=lambda: 1.0, host="n")
    log.emit("job_start", world_size=1)
    with open(path, "a") as f:  # a rank killed mid-write
        f.write('{"time": 2.0, "event": "checkpoint_sa')
    EventLog(path, job_id="1", restart_count=1, clock=lambda: 3.0, host="n").emit("job_start", world_size=1)
    events, torn = read_events_counted(path)
    assert [(e["event"], e["restart_count"]) for e in events] == [("job_start", 0), ("job_start", 1)]
    assert torn == 1
    assert path.read_bytes().endswith(b"\n") and path.read_text().count("\n") == 3


def test_writer_does_not_add_blank_lines_to_an_intact_log(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, clock=lambda: 1.0, host="n")
    for i in range(3):
        log.emit("iteration", step=i)
    assert path.read_text().count("\n") == 3 and read_events_counted(path) == (read_events(path), 0)


def test_status_reports_torn_lines_and_counts_every_attempt(tmp_path: Path) -> None:
    from launch.compose import compose_job, job_to_yaml
    from launch.run_state import gather

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    job = compose_job(["cluster=local", "model=tiny", "run.name=r"])
    (run_dir / "config.yaml").write_text(job_to_yaml(job))
    path = run_dir / "events.jsonl"
    EventLog(path, clock=lambda: 1.0, host="n").emit("job_start", world_size=1)
    with open(path, "a") as f:
        f.write('{"time": 2.0, "event": "iter')
    EventLog(path, restart_count=1, clock=lambda: 3.0, host="n").emit("job_start", world_size=1)
    state = gather(run_dir, alive=lambda *a, **k: False)
    assert any("1 torn or unreadable line" in w for w in state.warnings), state.warnings
    assert len([e for e in read_events(path) if e["event"] == "job_start"]) == 2


def test_the_analysis_reader_skips_and_counts_a_torn_line(tmp_path: Path) -> None:
    from analysis.parse_events import parse_events_file

    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps({"time": 1.0, "event": "job_start"}) + "\n" + '{"time": 2.0, "ev')
    EventLog(path, clock=lambda: 3.0, host="n").emit("exit", reason="completed")
    df, skipped = parse_events_file(path)
    assert list(df["event"]) == ["job_start", "exit"] and skipped == 1
