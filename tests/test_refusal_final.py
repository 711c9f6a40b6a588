"""A refusal is final everywhere, and a refused job never writes into another job's records.

Fake Slurm at the subprocess boundary; the run lock, the event log, the submit lock and the
batch-script helpers are real.
"""
from __future__ import annotations

import io
import os
import socket
import time
from pathlib import Path

import pytest
from fake_slurm import FakeSlurm
from hydra import compose, initialize_config_dir

from launch import pretrain
from launch.compose import CONFIG_DIR
from launch.config import register_configs
from launch.local import Attempt
from launch.paths import RunPaths
from launch.submit import SubmitLock, read_submissions
from recovery import exclusion, lock, policy
from recovery.crash import main as crash_main
from recovery.crash import requeue_after_crash
from recovery.events import EventLog

ME = {"SLURM_JOB_ID": "78", "SLURM_RESTART_COUNT": "0", "SLURM_JOB_NODELIST": "stn[1-2]"}


class ActiveJobs(FakeSlurm):
    """squeue lists the given jobs as RUNNING (``%i|%T``), every other job as ended."""

    def __init__(self, active=(), **kw):
        super().__init__(**kw)
        self.active = {str(j) for j in active}

    def _squeue(self, argv):
        ids = argv[argv.index("-j") + 1].split(",") if "-j" in argv else []
        return self._done(argv, 0, "".join(f"{j}|RUNNING\n" for j in ids if j in self.active))


def holder_running(run_dir: Path, job_id: str = "77") -> bytes:
    """Job ``job_id`` holds the run lock and has written its records; returns events.jsonl as it is."""
    me = lock.Holder(host="stn1", pid=4321, job_id=job_id, start_time=time.time())
    lock.acquire(RunPaths.of(run_dir).lock, me, host="stn1")
    log = EventLog(RunPaths.of(run_dir).events, job_id=job_id, restart_count=0, clock=lambda: 1.0, host="stn1")
    log.emit("job_start", world_size=2)
    log.emit("iteration", step=3)
    return RunPaths.of(run_dir).events.read_bytes()


@pytest.mark.parametrize("rc", sorted(policy.REFUSAL_CODES))
def test_crash_never_requeues_a_final_exit_code_and_writes_nothing(tmp_path: Path, rc: int) -> None:
    fake = FakeSlurm(job_id="78")
    code, why = requeue_after_crash(tmp_path, ME, fake, rc=rc)  # no event at all: "killed" without the rc
    assert code == 0 and fake.calls == []
    assert f"srun exited {rc} ({policy.code_name(rc)})" in why and "not requeued" in why
    assert not RunPaths.of(tmp_path).events.exists()


def test_a_job_refused_by_the_run_lock_is_not_requeued_and_leaves_the_holders_records(tmp_path: Path, capsys) -> None:
    before = holder_running(tmp_path, "77")
    fake = ActiveJobs(active=["77"], job_id="78")
    # srun's code says 143 (--kill-on-bad-exit), the refused ranks wrote no event: the lock tells
    assert crash_main([str(tmp_path), "--rc", "143"], env=ME, runner=fake) == 0
    assert "does not hold the run lock" in capsys.readouterr().out
    assert fake.called("scontrol") == []
    assert RunPaths.of(tmp_path).events.read_bytes() == before
    # the exclusion check before srun writes nothing either (and never requeues on the holder's account), even on
    # a node that is recorded as failed, where it would otherwise requeue away and log an ``exclude`` event
    policy.record_failed_node(tmp_path, "stn1", "test", job_id="77")
    assert exclusion.main(["start", str(tmp_path)], env=ME, runner=fake) == exclusion.EXIT_TRAIN
    assert fake.called("scontrol", "requeue") == [] and RunPaths.of(tmp_path).events.read_bytes() == before


def test_the_holders_own_crash_is_still_requeued(tmp_path: Path) -> None:
    holder_running(tmp_path, "77")  # its lock is left behind by the crash: the same job, not a foreign one
    fake = ActiveJobs(active=["77"], job_id="77")
    code, why = requeue_after_crash(tmp_path, {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0"}, fake, rc=143)
    assert code == 42 and fake.called("scontrol", "requeue") == [["scontrol", "requeue", "77"]]


def test_a_lock_whose_holder_ended_does_not_block_the_crash_requeue(tmp_path: Path) -> None:
    holder_running(tmp_path, "77")
    fake = ActiveJobs(active=[], job_id="78")  # job 77 has ended: its record is stale
    code, _ = requeue_after_crash(tmp_path, ME, fake, rc=1)
    assert code == 42


def test_crash_cli_reads_rc_and_refuses_bad_usage(tmp_path: Path) -> None:
    assert crash_main([str(tmp_path), "--rc", "9"], env=ME, runner=FakeSlurm()) == 0
    assert crash_main([str(tmp_path), "--rc"], env=ME, runner=FakeSlurm()) == 2


def test_local_launcher_a_refusal_outranks_a_crash() -> None:
    assert Attempt(0, [-15, 9]).code == 9  # rank 1 refused, rank 0 killed by the launcher: final, no relaunch
    assert Attempt(0, [1, 10]).code == 10
    assert Attempt(0, [42, 1]).code == 1
    assert all(c in policy.FINAL_CODES for c in policy.REFUSAL_CODES)


# ---- one submitter per run --------------------------------------------------------------------------------

def _cfg(overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _overrides(tmp_path):
    return ["cluster=lustre", "model=7b", "run.name=dup", f"cluster.run_root={tmp_path / 'runs'}", "force=true"]


def test_two_concurrent_submissions_of_one_run_queue_one_job(tmp_path: Path) -> None:
    """The second pretrain.py starts while the first is between its squeue check and its sbatch."""
    seen = {}

    class Racing(FakeSlurm):
        def _sbatch(self, argv):
            if "second" not in seen:  # the other pretrain.py arrives now: the queue is still empty
                err = io.StringIO()
                seen["second"] = pretrain.main(_cfg(_overrides(tmp_path)), runner=self, out=io.StringIO(), err=err)
                seen["err"] = err.getvalue()
            return super()._sbatch(argv)

    fake = Racing(job_id="500")
    assert pretrain.main(_cfg(_overrides(tmp_path)), runner=fake, out=io.StringIO(), err=io.StringIO()) == 0
    assert seen["second"] == pretrain.EXIT_REFUSED
    lines = seen["err"].strip().splitlines()
    assert lines[0].startswith("refused: 1 problem(s)") and "another pretrain.py is submitting this run" in lines[1]
    assert f"pid {os.getpid()} on {socket.gethostname()}" in seen["err"]
    assert len(fake.called("sbatch")) == 1
    run_dir = tmp_path / "runs" / "dup"
    assert [r["job_id"] for r in read_submissions(run_dir)] == ["500"]
    assert not RunPaths.of(run_dir).submit_lock.exists()  # released after the record


def test_after_the_first_submission_the_next_one_sees_it_in_squeue(tmp_path: Path) -> None:
    fake = ActiveJobs(job_id="600")
    assert pretrain.main(_cfg(_overrides(tmp_path)), runner=fake, out=io.StringIO(), err=io.StringIO()) == 0
    fake.active = {"600"}
    err = io.StringIO()
    assert pretrain.main(_cfg(_overrides(tmp_path)), runner=fake, out=io.StringIO(), err=err) == pretrain.EXIT_REFUSED
    assert "already has a job queued or running" in err.getvalue() and len(fake.called("sbatch")) == 1


def test_a_refused_first_submission_leaves_no_run_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "dup"
    other, problem = SubmitLock.take(run_dir)  # another pretrain.py of this run is submitting
    assert problem is None and run_dir.exists()
    fake = FakeSlurm()
    err = io.StringIO()
    assert pretrain.main(_cfg(_overrides(tmp_path)), runner=fake, out=io.StringIO(), err=err) == pretrain.EXIT_REFUSED
    assert fake.called("sbatch") == [] and sorted(p.name for p in run_dir.iterdir()) == ["submit.lock"]
    other.release()
    assert not (tmp_path / "runs").exists()  # the holder's release removes what taking the lock created


def test_a_dead_submitters_lock_is_stale(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "dup"
    dead = lock.Holder(host=socket.gethostname(), pid=2 ** 22 + 17, start_time=1.0)
    lock.acquire(RunPaths.of(run_dir).submit_lock, dead)
    assert pretrain.main(_cfg(_overrides(tmp_path)), runner=FakeSlurm(), out=io.StringIO(), err=io.StringIO()) == 0
