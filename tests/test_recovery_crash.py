"""recovery.crash: which ended attempts the batch script requeues (fake scontrol at the boundary)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_slurm import FakeSlurm

from recovery.crash import main, requeue_after_crash
from recovery.events import EventLog, read_events

ENV = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}


def attempt(run_dir: Path, restart: int, *events: tuple[str, dict]) -> None:
    log = EventLog(run_dir / "events.jsonl", job_id="77", restart_count=restart, clock=lambda: 1.0, host="n1")
    for name, fields in events:
        log.emit(name, **fields)


def test_a_crashed_attempt_is_requeued_and_says_so(tmp_path: Path) -> None:
    attempt(tmp_path, 0, ("exit", {"reason": "requeue", "code": 42}))  # an earlier attempt: not this one
    attempt(tmp_path, 1, ("job_start", {}), ("stop", {"reason": "crash", "detail": "RuntimeError: NCCL watchdog"}),
            ("exit", {"reason": "error", "code": 1}))
    fake = FakeSlurm()
    code, why = requeue_after_crash(tmp_path, ENV, fake)
    assert code == 42 and fake.calls == [["scontrol", "requeue", "77"]]
    assert "NCCL watchdog" in why
    last = read_events(tmp_path / "events.jsonl")[-1]
    assert last["event"] == "requeue" and last["method"] == "scontrol_after_crash" and last["ok"] is True


def test_an_attempt_killed_before_it_could_write_its_exit_is_requeued(tmp_path: Path) -> None:
    attempt(tmp_path, 1, ("job_start", {}), ("iteration", {"step": 3}))
    fake = FakeSlurm()
    assert requeue_after_crash(tmp_path, ENV, fake)[0] == 42
    assert len(fake.calls) == 1


@pytest.mark.parametrize("exit_reason,stop_reason", [
    ("requeue", None),  # the stop path already asked Slurm for the requeue
    ("completed", None),
    ("zero_progress", "zero_progress"),  # the guard's decision must not be undone
    ("max_restarts", "max_restarts"),
    ("error", "optimizer_mismatch"),  # a refusal repeats on every attempt (events of older versions)
    ("checkpoint_mismatch", "checkpoint_mismatch"),  # final: exit 15
])
def test_decisions_of_the_worker_are_not_requeued(tmp_path: Path, exit_reason: str, stop_reason) -> None:
    events = [("job_start", {})]
    if stop_reason:
        events.append(("stop", {"reason": stop_reason}))
    events.append(("exit", {"reason": exit_reason}))
    attempt(tmp_path, 1, *events)
    fake = FakeSlurm()
    code, why = requeue_after_crash(tmp_path, ENV, fake)
    assert code == 0 and fake.calls == []
    assert exit_reason in why


def test_a_refused_requeue_leaves_the_failure_code_and_is_logged(tmp_path: Path) -> None:
    attempt(tmp_path, 1, ("stop", {"reason": "crash"}), ("exit", {"reason": "error"}))
    code, why = requeue_after_crash(tmp_path, ENV, FakeSlurm(fail={"scontrol requeue"}, fail_words="Job is completing"))
    assert code == 0 and "failed" in why
    last = read_events(tmp_path / "events.jsonl")[-1]
    assert last["ok"] is False and "completing" in last["error"]


def test_outside_slurm_and_usage(tmp_path: Path, capsys) -> None:
    assert requeue_after_crash(tmp_path, {}, FakeSlurm())[0] == 0
    assert main([], env={}) == 2
    attempt(tmp_path, 1, ("stop", {"reason": "crash"}), ("exit", {"reason": "error"}))
    assert main([str(tmp_path)], env=ENV, runner=FakeSlurm()) == 42
    assert "requeued" in capsys.readouterr().out
    assert json.loads((tmp_path / "events.jsonl").read_text().splitlines()[-1])["job_id"] == "77"


def test_the_restart_limit_counts_failures_not_planned_slices(tmp_path: Path) -> None:
    """30 planned slice requeues, then a crash: with training.max_restarts 2 the crash is requeued (1 unplanned);
    after 2 earlier failures in the chain the third is not (another attempt would be refused)."""
    from recovery import policy

    (tmp_path / "config.yaml").write_text("training:\n  max_restarts: 2\n")

    class T:
        max_restarts, zero_progress_restarts = 2, 0

    def chain(planned: list[bool]) -> dict:
        for restart, ok in enumerate(planned):
            assert policy.start_decision(tmp_path, restart, restart * 10 or None, T, job_id="77").ok
            if ok:
                assert policy.mark_planned_stop(tmp_path, restart, "77", restart * 10)
        restart = len(planned)
        assert policy.start_decision(tmp_path, restart, restart * 10, T, job_id="77").ok
        attempt(tmp_path, restart, ("job_start", {}), ("stop", {"reason": "crash", "detail": "RuntimeError: boom"}),
                ("exit", {"reason": "error", "code": 1}))
        return {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": str(restart)}

    fake = FakeSlurm()
    assert requeue_after_crash(tmp_path, chain([True] * 30), fake)[0] == 42
    (tmp_path / "progress.json").unlink()
    code, why = requeue_after_crash(tmp_path, chain([True] * 10 + [False] + [True] * 10 + [False] + [True] * 8),
                                    FakeSlurm())
    assert code != 42 and "unplanned restart 3 > training.max_restarts 2 (28 planned slice requeues not counted)" \
        in why, why
