"""A stop signal during an asynchronous checkpoint write, on the real local Slurm cluster.

``scancel --signal=USR2 <job>`` (a user's requeue request) reaches every srun task while the
step-3 save is being written in the background (``SLURMTRON_TEST_ASYNC_WRITE_SLEEP_S`` holds
the forked writers; the test waits for ``checkpoint_async_started``). The ranks agree on the
stop, wait for the save in flight to be written and committed (``checkpoint_wait``), save the
stop step synchronously, and rank 0 requeues the job; the next attempt resumes exactly at the
stop step and completes: every step is trained exactly once.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from recovery.events import read_events
from slurm_cluster import Cluster
from test_slurm_long_runs import _iterations, _logs, _submit_rendered


@pytest.mark.slurm
@pytest.mark.timeout(420)
def test_user_requeue_during_an_async_write_waits_saves_and_resumes(slurm_cluster: Cluster, tmp_path: Path) -> None:
    iters = 10
    # the writers wait 8 s: the USR2 must reach the ranks (poll, scancel, slurmctld, slurmd, slurmstepd) and be agreed
    # at a step boundary while the save is still in flight, also on a loaded machine where each hop takes seconds
    env = {**slurm_cluster.env, "SLURMTRON_TEST_STEP_SLEEP_S": "1", "SLURMTRON_TEST_ASYNC_WRITE_SLEEP_S": "8"}
    run_dir = tmp_path / "asyncstop"
    overrides = ["cluster=slurm_local", f"cluster.run_root={tmp_path}", "run.name=asyncstop", "cluster.nodes=1",
                 "run.time_limit_min=5", f"training.train_iters={iters}", "training.checkpoint_interval=3",
                 "training.async_save=true"]
    job_id = _submit_rendered(slurm_cluster, run_dir, overrides, env)

    deadline = time.monotonic() + 200
    while not [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "checkpoint_async_started"]:
        assert time.monotonic() < deadline, slurm_cluster.sacct_dump(job_id) + _logs(run_dir)
        time.sleep(0.3)
    slurm_cluster.run("scancel", "--signal=USR2", job_id)

    final = slurm_cluster.wait_end(job_id, timeout=300)
    diag = slurm_cluster.sacct_dump(job_id) + _logs(run_dir)
    assert final == "COMPLETED", diag
    events = read_events(run_dir / "events.jsonl")
    first = [e for e in events if e.get("restart_count") == 0]
    [started] = [e["step"] for e in first if e["event"] == "checkpoint_async_started"]
    [sig] = [e for e in first if e["event"] == "signal"]
    assert sig["signal"] == "SIGUSR2" and sig["step"] >= started, diag
    [wait] = [e for e in first if e["event"] == "checkpoint_wait"]
    assert wait["step"] == started and wait["reason"] == "signal", diag
    saved = [(e["step"], e.get("mode")) for e in first if e["event"] == "checkpoint_saved"]
    assert saved[0] == (started, "async"), diag  # the save in flight became durable first ...
    assert saved[-1][0] == sig["step"], diag  # ... then the stop step
    assert [(e["reason"], e["requeue"]) for e in first if e["event"] == "stop"] == [("user_requeue", True)], diag
    assert [e["step"] for e in events if e["event"] == "resume"] == [sig["step"]], diag
    steps = _iterations(events)
    assert sorted(steps) == list(range(1, iters + 1)) and len(steps) == iters, diag  # nothing lost or repeated
