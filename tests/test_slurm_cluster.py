"""The local Slurm cluster itself: what every end-to-end test relies on.

These need only Slurm (no training): the nodes and their fake GPUs, a job that completes and
is recorded by sacct, the scheduler's own check of a script, and node names that resolve.
"""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from slurm_cluster import Cluster, ClusterSpec, Layout, hosts_line, with_hosts_line, without_hosts_line

SCRIPT = """#!/bin/bash
#SBATCH --job-name=handwritten
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --gpus-per-node=2
#SBATCH --time=5
#SBATCH --requeue
#SBATCH --signal=USR2@30
#SBATCH --open-mode=append
#SBATCH --output={out}/%j_%t.out
srun bash -c 'echo "$SLURM_PROCID $SLURMD_NODENAME $CUDA_VISIBLE_DEVICES $(getent hosts "$MASTER" | head -n 1 | cut -d" " -f1)"'
"""


@pytest.mark.slurm
def test_every_node_is_up_with_eight_gpus(slurm_cluster: Cluster) -> None:
    out = slurm_cluster.run("sinfo", "-h", "-N", "-p", slurm_cluster.spec.partition, "-o", "%N %G").stdout
    gres = dict(line.split() for line in out.splitlines())
    assert sorted(gres) == sorted(slurm_cluster.spec.node_names)
    assert set(gres.values()) == {"gpu:8"}


@pytest.mark.slurm
def test_node_names_resolve_to_loopback(slurm_cluster: Cluster) -> None:
    for name in slurm_cluster.spec.node_names:
        assert socket.gethostbyname(name) == "127.0.0.1"


@pytest.mark.slurm
def test_a_two_node_job_completes_and_sacct_records_it(slurm_cluster: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text(SCRIPT.format(out=tmp_path).replace(
        "srun", 'MASTER=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\nexport MASTER\nsrun', 1))
    job_id = slurm_cluster.run("sbatch", "--parsable", f"--chdir={tmp_path}", str(script)).stdout.strip()

    assert slurm_cluster.wait_end(job_id, timeout=60) == "COMPLETED", slurm_cluster.sacct_dump(job_id)
    lines = sorted((tmp_path / f"{job_id}_0.out").read_text().split("\n"))
    lines = [line.split() for line in lines if line.strip()]
    # 4 tasks over 2 distinct nodes, 2 GPUs each, and the first node's name resolves in the job
    assert sorted(int(x[0]) for x in lines) == [0, 1, 2, 3]
    assert len({x[1] for x in lines}) == 2
    assert {x[2] for x in lines} == {"0,1"}
    assert {x[3] for x in lines} == {"127.0.0.1"}
    steps = {r["JobID"]: r["State"] for r in parse_dump(slurm_cluster.sacct_dump(job_id))}
    assert steps[job_id] == "COMPLETED" and steps[f"{job_id}.0"] == "COMPLETED"


@pytest.mark.slurm
def test_scheduler_accepts_a_fitting_script_and_refuses_a_larger_one(slurm_cluster: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text(SCRIPT.format(out=tmp_path))
    ok = slurm_cluster.run("sbatch", "--test-only", str(script), check=False)
    assert ok.returncode == 0, ok.stderr
    assert "to start at" in ok.stderr
    nodes = slurm_cluster.spec.nodes
    for extra, why in (("--gpus-per-node=9", "Requested node configuration is not available"),
                       (f"--nodes={nodes + 1}", "Node count specification invalid")):
        bad = slurm_cluster.run("sbatch", "--test-only", extra, str(script), check=False)
        assert bad.returncode != 0, f"{extra} was accepted: {bad.stderr}"
        assert why in bad.stderr


def test_hosts_line_is_added_once_and_removed() -> None:
    line = hosts_line(ClusterSpec(nodes=2), Layout(Path("/x")))
    text = "127.0.0.1 localhost\n"
    added = with_hosts_line(with_hosts_line(text, line), line)
    assert added.count(line) == 1
    assert without_hosts_line(added, line) == text


def parse_dump(text: str) -> list[dict[str, str]]:
    """Rows of ``sacct --parsable2`` output (the header line names the fields)."""
    lines = [line for line in text.splitlines() if line.strip()]
    keys = lines[0].split("|")
    return [dict(zip(keys, line.split("|"))) for line in lines[1:]]
