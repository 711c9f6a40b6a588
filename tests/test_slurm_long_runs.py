"""Bad nodes on the real local Slurm cluster (``tests/slurm_cluster.py``). (A run longer than its
time limit, over several slices, is a scenario of ``test_slurm_e2e.py``: it waits beside the others.)

* A node that fails (NODE_FAIL: the admin marks it down under the running job) is learned by
  the next attempt from ``sacct -D`` and the accounting event table, recorded in
  ``failed_nodes.json``, and kept out of the attempt that finishes the run.

The worker's test hook ``SLURMTRON_TEST_STEP_SLEEP_S`` makes each step last one second, so the
signal lands mid-run; sbatch exports it from the submitting environment.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from launch.compose import compose_job, job_to_yaml  # noqa: E402
from launch.dist_env import rendezvous_port_shell  # noqa: E402
from launch.render import render  # noqa: E402
from recovery import policy  # noqa: E402
from recovery.events import read_events  # noqa: E402
from slurm_cluster import Cluster  # noqa: E402

START_CHECK = 'python3 -m recovery.exclusion start "$RUN_DIR"\n[ $? -eq 42 ] && exit 42\n'


def _iterations(events: list[dict]) -> list[int]:
    return [e["step"] for e in events if e["event"] == "iteration"]


def _submit_rendered(cluster: Cluster, run_dir: Path, overrides: list[str], env: dict) -> str:
    """What pretrain.py does (compose, config.yaml, render, sbatch), with a free MASTER_PORT pinned."""
    job = compose_job(overrides)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    (run_dir / "config.yaml").write_text(job_to_yaml(job))
    script = render(job, run_dir)
    # Every test cluster numbers its jobs from 1 and the script derives MASTER_PORT from the job
    # id, so two clusters on one machine (parallel CI jobs) collide; pin a free port instead.
    derived = f"export MASTER_PORT={rendezvous_port_shell()}"
    assert script.count(derived) == 1, script
    script = script.replace(derived, f"export MASTER_PORT={free_port()}")
    assert script.count(START_CHECK) == 1, script  # the rendered attempt-start check (sbatch_templates/srun.sh)
    path = run_dir / "sbatch.sh"
    path.write_text(script)
    proc = subprocess.run(["sbatch", "--parsable", str(path)], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _logs(run_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                     for p in sorted((run_dir / "logs").glob("*.out")))


@pytest.mark.slurm
@pytest.mark.timeout(420)
def test_failed_node_is_excluded_on_the_retry(slurm_cluster: Cluster, tmp_path: Path) -> None:
    spec = slurm_cluster.spec
    pool = spec.node_names[:2]  # the job may use only these two, so the retry could land on the failed one
    run_dir = tmp_path / "badnode"
    overrides = ["cluster=slurm_local", f"cluster.run_root={tmp_path}", "run.name=badnode", "cluster.nodes=1",
                 "cluster.gpus_per_node=1", "parallelism=tp1",
                 "run.time_limit_min=5", "training.train_iters=12", "training.checkpoint_interval=2",
                 f"cluster.exclude='{','.join(spec.node_names[2:])}'"]
    env = {**slurm_cluster.env, "SLURMTRON_TEST_STEP_SLEEP_S": "1"}
    job_id = _submit_rendered(slurm_cluster, run_dir, overrides, env)

    deadline = time.monotonic() + 150
    while not any(s >= 3 for s in _iterations(read_events(run_dir / "events.jsonl"))):
        assert time.monotonic() < deadline, slurm_cluster.sacct_dump(job_id) + _logs(run_dir)
        time.sleep(1)
    bad = slurm_cluster.job(job_id)["NodeList"]
    assert bad in pool
    slurm_cluster.run("scontrol", "update", f"nodename={bad}", "state=down", "reason=slurmtron test: ECC errors")

    final = slurm_cluster.wait_end(job_id, timeout=300)
    diag = slurm_cluster.sacct_dump(job_id) + _logs(run_dir)
    assert final == "COMPLETED", diag
    recorded = policy.failed_nodes(run_dir)
    assert [r["host"] for r in recorded] == [bad], diag
    assert "ECC errors" in recorded[0]["reason"] and recorded[0]["job_id"] == job_id
    rows = slurm_cluster.sacct(job_id)
    assert rows[0]["State"] == "NODE_FAIL" and rows[0]["NodeList"] == bad, diag
    assert rows[-1]["State"] == "COMPLETED" and rows[-1]["NodeList"] != bad, diag  # the run ended elsewhere
    events = read_events(run_dir / "events.jsonl")
    landed_again = [r for r in rows[1:-1] if r["NodeList"] == bad]
    excludes = [e for e in events if e["event"] == "exclude"]
    # an attempt that landed on the failed node again requeued itself away from it
    assert len(excludes) == len(landed_again), diag
    if landed_again:
        assert bad in slurm_cluster.hostnames(slurm_cluster.job(job_id)["ExcNodeList"]), diag
    assert max(_iterations(events)) == 12
    assert [e["step"] for e in events if e["event"] == "train_end"] == [12]
