"""A multi-week run through the real restart policy: ``training.max_restarts`` counts failures, not slices.

Simulated: this machine cannot run 50 days on 16 nodes. What is real is every decision: each attempt asks
:func:`recovery.policy.start_decision` (its records in a temporary run directory's ``progress.json``), a planned
slice end goes through :func:`recovery.policy.after_stop_save` (its mark in ``progress.json``, its ``requeue``
event in ``events.jsonl``), and the requeue is ``scontrol requeue`` of the fake Slurm at the subprocess
boundary (tests/fake_slurm.py). 1,200 one-hour slices of work, i.e. 1,199 requeues without failures.
``SLURM_RESTART_COUNT`` is what Slurm makes it: the number of requeues the job
has had, planned or not. What is simulated is the training between two decisions (the step a slice reaches, the
checkpoints it commits) and the failures.

The failure rate. Llama 3 (Dubey et al. 2024, section 3.3.4): 419 unexpected interruptions in 54 days on
16,384 GPUs, one every 3.1 hours, i.e. 419 / (54 x 24 x 16,384) = 1.97e-5 per GPU-hour. A 16-node run of
128 GPUs meets 128 x 1.97e-5 = 0.0025 per hour, one every ~400 hours: about 3 in a 1,200-hour run. The
campaign uses five times that (15 failures, one every 80 slices: crashes, hangs, node failures and a time limit
that got no signal), so the run is not judged on a lucky draw; each failure comes after a periodic checkpoint,
as a failure usually does (30 minutes into a slice with a 15-minute checkpoint interval). Note that
``max_restarts`` bounds the unplanned restarts of the whole chain: at the Llama 3 rate a 512-node (4,096-GPU)
run meets about 0.08 per hour, ~97 in 1,200 hours, and needs ``training.max_restarts`` raised to match
(docs/recovery.md).
"""
from __future__ import annotations

import json
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest
from fake_slurm import FakeSlurm

from launch.config import TrainingConfig
from recovery import policy
from recovery.events import EventLog, read_events
from recovery.exit_codes import EXIT_MAX_RESTARTS, EXIT_REQUEUE, EXIT_ZERO_PROGRESS
from recovery.storage import LocalStorage

JOB = "4242"
SLICES = 1200  # 50 days of one-hour slices: 1,199 planned requeues
STEPS_PER_SLICE = 100
CHECKPOINT_INTERVAL = 25  # steps: four periodic checkpoints per slice, the stop checkpoint at its end
FAILURE_EVERY = 80  # slices: 15 failures in 1,200 slices, 5x the Llama 3 rate scaled to 128 GPUs
FAILURES = ("crash", "hang", "node_failure", "timeout_without_signal")


class TmpStorage(LocalStorage):
    """The run directory's storage without the durability: no fsync, compact JSON. progress.json holds a record
    per attempt, and rewriting 1,200 of them with fsyncs 2,400 times is minutes, not what is tested here."""

    def atomic_write_json(self, path, doc) -> None:
        Path(path).write_text(json.dumps(doc, default=str))


STORAGE = TmpStorage()


@pytest.fixture
def run_dir(tmp_path: Path):
    """A run directory in memory where the machine has one (/dev/shm): the event log fsyncs every line."""
    if not Path("/dev/shm").is_dir():
        yield tmp_path
        return
    d = Path(tempfile.mkdtemp(prefix="campaign-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@dataclass
class Campaign:
    """One job's attempts, decided by the real policy; the fake Slurm counts the requeues."""

    run_dir: Path
    training: TrainingConfig
    slurm: FakeSlurm = field(default_factory=lambda: FakeSlurm(job_id=JOB))
    latest: Optional[int] = None  # the newest committed checkpoint's step
    attempts: int = 0
    refused: Optional[policy.Decision] = None
    failures: dict = field(default_factory=dict)
    clock: float = 0.0
    _seen: int = 0
    _requeues: int = 0

    def restart_count(self) -> int:
        """``SLURM_RESTART_COUNT``: Slurm raises it on every requeue of the job (the fake's ``scontrol requeue``
        calls, counted as they come)."""
        new = self.slurm.calls[self._seen:]
        self._seen += len(new)
        self._requeues += sum(1 for c in new if c[:2] == ["scontrol", "requeue"])
        return self._requeues

    def env(self) -> dict:
        return {"SLURM_JOB_ID": JOB, "SLURM_RESTART_COUNT": str(self.restart_count())}

    def start(self) -> bool:
        """Rank 0's start decision for the next attempt; False (and ``refused``) when it refuses."""
        self.attempts += 1
        self.clock += 3600.0
        d = policy.start_decision(self.run_dir, self.restart_count(), self.latest, self.training,
                                  clock=lambda: self.clock, job_id=JOB, storage=STORAGE)
        if not d.ok:
            self.refused = d
        return d.ok

    def planned_slice(self) -> None:
        """A whole slice: the warning signal, the stop checkpoint committed, rank 0 asks for the requeue. The slice
        that reaches the last step completes the run instead (exit 0, no requeue)."""
        step = (self.latest or 0) + STEPS_PER_SLICE
        self.latest = step
        if self.done():
            return
        events = EventLog(self.run_dir / "events.jsonl", job_id=JOB, restart_count=self.restart_count(),
                          clock=lambda: self.clock, host="n1")
        code = policy.after_stop_save(signal.SIGUSR2, self.env(), self.slurm, events=events, step=step,
                                      run_dir=self.run_dir, storage=STORAGE)
        assert code == EXIT_REQUEUE

    def failed_slice(self, kind: str, progress: bool = True) -> None:
        """A failure: with ``progress``, after the slice's second periodic checkpoint; without, before its first.
        No stop checkpoint, no mark; Slurm (or recovery.crash) requeues the job."""
        if progress:
            self.latest = (self.latest or 0) + 2 * CHECKPOINT_INTERVAL
        self.failures[kind] = self.failures.get(kind, 0) + 1
        self.slurm(["scontrol", "requeue", JOB])

    def done(self) -> bool:
        return (self.latest or 0) >= SLICES * STEPS_PER_SLICE


def test_fifty_days_of_slices_and_a_realistic_failure_rate_finish(run_dir: Path) -> None:
    c = Campaign(run_dir, TrainingConfig())
    assert (c.training.max_restarts, c.training.zero_progress_restarts) == (20, 3)  # the defaults are tested
    while not c.done():
        assert c.start(), c.refused.detail
        if c.attempts % FAILURE_EVERY == 0:
            c.failed_slice(FAILURES[(c.attempts // FAILURE_EVERY) % len(FAILURES)])
        else:
            c.planned_slice()
    unplanned = sum(c.failures.values())
    assert unplanned == 15 and c.failures == {"crash": 3, "hang": 4, "node_failure": 4, "timeout_without_signal": 4}
    # a failed slice keeps the half it checkpointed: 1,200 slices of work took 1,193 whole ones and 15 halves
    # (119,300 + 750 steps >= 120,000; 1,192 whole ones would leave 50 to do)
    assert c.attempts == 1193 + 15
    # every restart was decided by the policy: 1,207 restarts, 1,192 planned slice requeues and 15 failures...
    assert c.restart_count() == c.attempts - 1 == 1207
    records = policy.read_progress(run_dir)
    assert len(records) == c.attempts and all(r["decision"] in ("start", "resume") for r in records)
    # ...each planned requeue left its mark and its event, the failures and the completing slice none
    planned = sum(1 for r in records if r.get(policy.PLANNED_STOP))
    assert planned == c.attempts - unplanned - 1 == 1192
    assert policy.restart_tally(records[:-1], c.restart_count()) == (unplanned, planned)
    requeues = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "requeue"]
    assert len(requeues) == planned and all(e["planned"] and e["method"] == "scontrol" for e in requeues)
    # the old rule (restart count > max_restarts) would have stopped this run at its 22nd attempt
    assert c.restart_count() > 50 * c.training.max_restarts


def test_a_deterministic_crash_deep_in_the_run_stops_after_zero_progress_restarts(run_dir: Path) -> None:
    c = Campaign(run_dir, TrainingConfig())
    for _ in range(300):  # 300 planned slices first: they do not hide the crash loop
        assert c.start()
        c.planned_slice()
    crashes = 0
    while c.start():
        c.failed_slice("crash", progress=False)  # the same bug at the same step, before any new checkpoint
        crashes += 1
    n = c.training.zero_progress_restarts
    assert (c.refused.reason, c.refused.code) == ("zero_progress", EXIT_ZERO_PROGRESS)
    # the first crashing attempt started from a new checkpoint; the n restarts after it all from that one
    assert crashes == n and f"the last {n} consecutive restarts all started from checkpoint step 30000" \
        in c.refused.detail


def test_fifty_crashes_in_a_row_with_progress_stop_at_max_restarts(run_dir: Path) -> None:
    c = Campaign(run_dir, TrainingConfig())
    for _ in range(100):
        assert c.start()
        c.planned_slice()
    crashes = 0
    while crashes < 50 and c.start():
        c.failed_slice(FAILURES[crashes % len(FAILURES)], progress=True)  # each one after a new checkpoint
        crashes += 1
    limit = c.training.max_restarts
    assert c.refused is not None and (c.refused.reason, c.refused.code) == ("max_restarts", EXIT_MAX_RESTARTS)
    assert crashes == limit + 1  # the 21st failure's restart is refused, not the 101st+ slice
    assert c.refused.detail.startswith(f"{limit + 1} unplanned restarts (restart count {100 + limit + 1} - 100 "
                                       f"planned slice requeues, which are not counted) > training.max_restarts "
                                       f"{limit}"), c.refused.detail


def test_fifty_crashes_in_a_row_without_progress_meet_the_zero_progress_guard_first(run_dir: Path) -> None:
    c = Campaign(run_dir, TrainingConfig())
    crashes = 0
    while crashes < 50 and c.start():
        c.failed_slice("crash", progress=False)
        crashes += 1
    assert c.refused.reason == "zero_progress" and crashes == c.training.zero_progress_restarts
    assert "all started from no checkpoint" in c.refused.detail


def test_a_stop_without_a_checkpoint_is_not_planned(run_dir: Path) -> None:
    """A signal during start-up or a failed stop save asks for the requeue without a step: no mark, it counts."""
    c = Campaign(run_dir, TrainingConfig(max_restarts=1, zero_progress_restarts=0))
    for _ in range(2):
        assert c.start()
        assert policy.after_stop_save(signal.SIGUSR2, c.env(), c.slurm, run_dir=run_dir) == EXIT_REQUEUE
    assert not c.start() and c.refused.reason == "max_restarts"
    assert not any(r.get(policy.PLANNED_STOP) for r in policy.read_progress(run_dir))


def test_a_planned_stop_with_no_record_of_its_attempt_warns_and_counts(run_dir: Path, capsys) -> None:
    events = EventLog(run_dir / "events.jsonl", job_id=JOB, restart_count=3, clock=lambda: 1.0, host="n1")
    env = {"SLURM_JOB_ID": JOB, "SLURM_RESTART_COUNT": "3"}
    assert policy.after_stop_save(signal.SIGUSR2, env, FakeSlurm(job_id=JOB), events=events, step=70,
                                  run_dir=run_dir) == EXIT_REQUEUE
    assert "WARNING: no progress record of restart 3 (job 4242)" in capsys.readouterr().out
    (ev,) = read_events(run_dir / "events.jsonl")
    assert ev["planned"] is False and "counts against training.max_restarts" in ev["detail"]
