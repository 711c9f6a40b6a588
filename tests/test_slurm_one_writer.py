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
