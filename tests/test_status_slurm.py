"""``launch/status.py`` against the real local Slurm cluster: one tiny run seen pending (held by
``--begin``), running, then completed, through the same command a user types."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_cluster import Cluster, wait_until

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]


def status(cluster: Cluster, run_dir: Path) -> dict:
    proc = subprocess.run([PY, str(REPO / "launch" / "status.py"), str(run_dir), "--json"], capture_output=True,
                          text=True, timeout=120, env=cluster.env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout)


def test_status_follows_a_run_from_pending_to_completed(slurm_cluster: Cluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "watched"
    sub = subprocess.run(
        [PY, str(REPO / "launch" / "pretrain.py"), "cluster=slurm_local", f"cluster.python={PY}", "parallelism=tp2",
         f"run.dir={run_dir}", "run.name=watched", "run.time_limit_min=10", "+cluster.sbatch_extra.begin=now+1hour",
         "+cluster.env.SLURMTRON_TEST_STEP_SLEEP_S=0.5", "cluster.gpu_hour_price=3"],
        capture_output=True, text=True, timeout=120, env=slurm_cluster.env, cwd=tmp_path)
    assert sub.returncode == 0, sub.stderr
    job_id = json.loads((run_dir / "submissions.jsonl").read_text().splitlines()[-1])["job_id"]

    st = status(slurm_cluster, run_dir)
    assert (st["state"], st["reason"], st["job_id"], st["attempts"]) == ("pending", "BeginTime", job_id, 0)
    assert st["target"] == 20 and st["step"] is None and st["checkpoint_step"] is None

    slurm_cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    seen: dict = {}

    def running_with_steps() -> bool:
        seen.update(status(slurm_cluster, run_dir))
        return seen["state"] == "running" and (seen["step"] or 0) >= 2

    wait_until(running_with_steps, 300, f"job {job_id} to run some steps", interval=2)
    assert seen["attempts"] == 1 and seen["step_time_s"] > 0 and seen["eta_s"] > 0 and seen["log_tail"]

    slurm_cluster.wait_end(job_id, 300)
    st = status(slurm_cluster, run_dir)
    assert (st["state"], st["step"], st["target"], st["checkpoint_step"]) == ("completed", 20, 20, 20)
    assert st["interruptions"] == {} and st["goodput"] is not None and 0 < st["goodput"] <= 1
    # the GPU-hours spent are Slurm's accounting of the allocation: its Elapsed x the ranks (no GPU gres here)
    elapsed = sum(int(h) * 3600 + int(m) * 60 + int(sec) for h, m, sec in
                  (r["Elapsed"].split(":") for r in slurm_cluster.sacct(job_id)))
    assert st["world_size"] == 4 and st["gpu_hours_source"] == "sacct"
    assert st["gpu_hours"] == pytest.approx(4 * elapsed / 3600)
    assert st["cost"] == pytest.approx(3 * st["gpu_hours"])
    text = subprocess.run([PY, str(REPO / "launch" / "status.py"), str(run_dir)], capture_output=True, text=True,
                          timeout=120, env=slurm_cluster.env).stdout
    assert f"state      completed; job {job_id}; attempts 1" in text and "step 20 / 20 (100.0%)" in text
    assert f"cost       {st['cost']:,.2f} (" in text and "x 3 per process-hour, so far, from the Slurm accounting" in text
