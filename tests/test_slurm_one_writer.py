"""One writer per run, on the real local Slurm cluster: the same run submitted twice is refused while its job waits.

The first job is held back by ``--begin=now+1hour`` (a real PENDING job that trains nothing),
so the test costs no training. The second ``pretrain.py`` of the same run asks ``squeue`` for
the job ids in ``submissions.jsonl`` and refuses; once the first job is cancelled (squeue then
reports it CANCELLED for a while, then forgets it) the run can be submitted again.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_cluster import Cluster

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]


def pretrain(cluster: Cluster, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "launch" / "pretrain.py"), "cluster=slurm_local",
           f"cluster.python={sys.executable}",
           f"run.dir={run_dir}", f"run.name={run_dir.name}", "run.time_limit_min=10",
           "+cluster.sbatch_extra.begin=now+1hour", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=cluster.env, cwd=run_dir.parent)


def job_ids(run_dir: Path) -> list:
    return [json.loads(x)["job_id"] for x in (run_dir / "submissions.jsonl").read_text().splitlines()]


def test_the_same_run_submitted_twice_is_refused_while_its_job_is_pending(slurm_cluster: Cluster,
                                                                          tmp_path: Path) -> None:
    run_dir = tmp_path / "twice"
    first = pretrain(slurm_cluster, run_dir)
    assert first.returncode == 0, first.stderr
    [job] = job_ids(run_dir)
    try:
        assert slurm_cluster.state(job) == "PENDING"
        second = pretrain(slurm_cluster, run_dir)
        assert second.returncode == 2, f"{second.stdout}\n{second.stderr}"
        assert f"job {job} PENDING" in second.stderr and f"scancel {job}" in second.stderr
        assert job_ids(run_dir) == [job]  # nothing more was queued
    finally:
        slurm_cluster.run("scancel", job, check=False)
    slurm_cluster.wait_end(job, 60)
    third = pretrain(slurm_cluster, run_dir)  # the first job is over (CANCELLED): the run may go on
    assert third.returncode == 0, third.stderr
    try:
        assert len(job_ids(run_dir)) == 2
    finally:
        slurm_cluster.run("scancel", job_ids(run_dir)[-1], check=False)


def test_two_concurrent_submissions_of_one_run_queue_one_job(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """Two pretrain.py of one run started at the same moment: exactly one job, one one-line refusal."""
    run_dir = tmp_path / "race"
    cmd = [sys.executable, str(REPO / "launch" / "pretrain.py"), "cluster=slurm_local",
           f"cluster.python={sys.executable}", f"run.dir={run_dir}", f"run.name={run_dir.name}",
           "run.time_limit_min=10", "+cluster.sbatch_extra.begin=now+1hour"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=slurm_cluster.env,
                              cwd=tmp_path) for _ in range(2)]
    done = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    try:
        assert sorted(rc for rc, _, _ in done) == [0, 2], done
        assert len(job_ids(run_dir)) == 1
        [(_, _, loser)] = [d for d in done if d[0] == 2]
        assert loser.startswith("refused: 1 problem(s)"), loser
        assert ("another pretrain.py is submitting this run" in loser
                or "already has a job queued or running" in loser), loser
    finally:
        for job in job_ids(run_dir):
            slurm_cluster.run("scancel", job, check=False)


def test_a_duplicate_job_started_by_hand_exits_once_and_writes_nothing(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """``sbatch`` of a running run's script by hand: the run lock refuses its ranks (exit 9), the batch script
    does not requeue it, and it writes nothing into the holder's records (events, progress)."""
    from recovery.events import read_events

    run_dir = tmp_path / "held"
    cmd = [sys.executable, str(REPO / "launch" / "pretrain.py"), "cluster=slurm_local",
           f"cluster.python={sys.executable}", f"run.dir={run_dir}", f"run.name={run_dir.name}",
           "run.time_limit_min=10", "+cluster.env.SLURMTRON_TEST_STEP_SLEEP_S=20",  # the holder outlives the test
           "cluster.nodes=1", "cluster.gpus_per_node=1", "parallelism=tp1"]  # one rank a job: the lock is the subject
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=slurm_cluster.env, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    [holder] = job_ids(run_dir)
    dup = ""
    try:
        from slurm_cluster import wait_until

        wait_until(lambda: any(e.get("event") == "iteration" for e in read_events(run_dir / "events.jsonl")), 300,
                   f"job {holder} to train its first step", interval=1)
        dup = slurm_cluster.run("sbatch", "--parsable", str(run_dir / "sbatch.sh")).stdout.strip().split(";")[0]
        final = slurm_cluster.wait_end(dup, 300)
        assert slurm_cluster.state(holder) == "RUNNING"  # the holder still held the run the whole time
        rows = slurm_cluster.sacct(dup)
        log = "\n".join(f.read_text(errors="replace") for f in (run_dir / "logs").glob(f"*{dup}*"))
        assert len(rows) == 1 and final.startswith("FAILED"), (rows, final, log[-3000:])
        assert int(slurm_cluster.job(dup).get("Restarts", "-1")) == 0
        assert "run_locked" in log and "srun exited 9" in log and "not requeued" in log, log[-3000:]
        events = read_events(run_dir / "events.jsonl")
        assert [e for e in events if str(e.get("job_id")) == dup] == []
        assert {str(e.get("job_id")) for e in events} == {holder}
        progress = json.loads((run_dir / "progress.json").read_text())
        assert {str(r.get("job_id")) for r in progress} == {holder}
    finally:
        slurm_cluster.run("scancel", holder, *([dup] if dup else []), check=False)
    slurm_cluster.wait_end(holder, 120)
