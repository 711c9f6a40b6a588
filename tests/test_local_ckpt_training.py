"""The node-local checkpoint tier on real Megatron-Core training: cluster=local, 2 simulated nodes x 1 rank (PP2, gloo),
each node with its own local directory, replication 2 (each node's shards also on the other node).

One run, three attempts, plus the uninterrupted reference run of the same job:

1. attempt 0 crashes at iteration 7 (every rank): local sets at 5 and 6, the global checkpoint at 4;
2. node1's local directory is removed (a lost node): attempt 1 resumes from the local set of step 6, node0's rank
   from its own copy, node1's from the replica on node0, sent over the process group; it loses no step (the
   global tier alone would have lost 2); it crashes at iteration 11 (local set 10, global 8);
3. one byte of node1's own copy of its shard in the local set of step 10 is flipped: the start passes over that copy
   (a WARNING and a ``local_checkpoint_skipped`` event) and chooses the set with node1's shard from its replica on
   node0; between that verification and the read (a test hook holds the ranks) one byte of the replica is flipped
   too: the read's SHA-256 check fails, every rank agrees, nothing is copied into the model, and attempt 2 resumes
   from the global checkpoint of step 8 (the newest verified source), with a WARNING and an event, and completes.

Every logged loss of every attempt equals the uninterrupted run's, bitwise, and the report's interruptions count
the steps each one lost (0 with the local set, 2 with the global checkpoint) and the tier the next attempt resumed
from. About 2-3 minutes on 2 busy cores (one stage per node: the lost node's stage exists only in its
replica).
"""
from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_cluster import wait_until
from trainutil import REPO, start_ranks, wait_ranks, write_job
from train.context import LOCAL_RESTORE_GATE_ENV
from launch.paths import LocalPaths
from recovery.events import read_events

pytestmark = pytest.mark.training

WORLD, PER_NODE, ITERS = 2, 1, 12
JOB = ["cluster=local", "model=tiny", "parallelism=pp2", "cluster.nodes=2", f"cluster.gpus_per_node={PER_NODE}",
       f"training.train_iters={ITERS}", "training.checkpoint_interval=4"]
TIMEOUT = 600


def run_attempt(run_dir: Path, attempt: int, fail_at: int = 0) -> list:
    env = {"SLURMTRON_TEST_FAIL_AT_ITER": str(fail_at)} if fail_at else {}
    return wait_ranks(start_ranks(run_dir, WORLD, attempt, env, per_node=PER_NODE), TIMEOUT)


def losses(events: list) -> dict:
    out: dict = {}
    for e in events:
        if e["event"] == "iteration":
            out.setdefault(e["step"], []).append(e["loss"])
    return out


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def logs(run_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in sorted((run_dir / "logs").glob("*.out")))


@pytest.mark.timeout(1500)
def test_local_sets_resume_from_own_copies_and_replicas_and_fall_back_past_a_corrupt_replica(tmp_path):
    ref_dir = tmp_path / "ref"
    write_job(ref_dir, [*JOB, f"run.dir={ref_dir}"])
    assert run_attempt(ref_dir, 0) == [0] * WORLD, logs(ref_dir)
    reference = {s: v[0] for s, v in losses(read_events(ref_dir / "events.jsonl")).items()}
    assert sorted(reference) == list(range(1, ITERS + 1))

    run_dir, local_root = tmp_path / "run", tmp_path / "node_local"
    write_job(run_dir, [*JOB, f"run.dir={run_dir}", "training.local_checkpoint.interval=1",
                        f"cluster.local_checkpoint_dir={local_root}"])
    paths = LocalPaths(local_root, "tiny")

    assert run_attempt(run_dir, 0, fail_at=7) == [1] * WORLD, logs(run_dir)
    ev = read_events(run_dir / "events.jsonl")
    assert [e["step"] for e in ev if e["event"] == "local_checkpoint_saved"] == [1, 2, 3, 5, 6]
    assert [p.name for p in paths.node_dir("node0").iterdir()] == ["local_0000006"]  # keep 1: older ones pruned
    shutil.rmtree(paths.node_dir("node1"))  # node1 is lost with its local directory

    assert run_attempt(run_dir, 1, fail_at=11) == [1] * WORLD, logs(run_dir)
    ev = read_events(run_dir / "events.jsonl")
    resumed = [e for e in ev if e["event"] == "resumed_from"]
    assert [(e["tier"], e["step"], e["global_step"], e["lost_steps"]) for e in resumed] == [("local", 6, 4, 0)]
    assert "on node(s) node0" in [e for e in ev if e["event"] == "resume"][-1]["checkpoint"]
    shard = LocalPaths.shard_files("node1", 1)[0]
    flip(paths.set_dir("node1", 10) / shard)  # node1's own copy: the start passes over it and takes the replica
    gate = tmp_path / "gate"
    ranks = start_ranks(run_dir, WORLD, 2, {LOCAL_RESTORE_GATE_ENV: str(gate)}, per_node=PER_NODE)
    log = run_dir / "logs" / "local_2_rank1.out"
    wait_until(lambda: log.exists() and "loading the local checkpoint" in log.read_text(), TIMEOUT,
               "attempt 2 to choose the local set of step 10")
    flip(paths.set_dir("node0", 10) / shard)  # ... and the replica, after the start verified it
    gate.touch()
    assert wait_ranks(ranks, TIMEOUT) == [0] * WORLD, logs(run_dir)
    ev = read_events(run_dir / "events.jsonl")
    resumed = [e for e in ev if e["event"] == "resumed_from"]
    assert [(e["tier"], e["step"], e["lost_steps"]) for e in resumed][1:] == [("global", 8, 2)]
    skipped = [e for e in ev if e["event"] == "local_checkpoint_skipped" and e.get("restart_count") == 2]
    assert any("checksum mismatch node1/rank_00001.safetensors" in e["reason"] for e in skipped), skipped
    late = [e for e in skipped if e["reason"] == "changed_after_verification"]
    assert [e["step"] for e in late] == [10] and "sha256 differs" in late[0]["detail"], skipped
    text = log.read_text()
    assert "WARNING: skipping the local set of step 10" in text  # the start's pass over node1's own copy
    assert "WARNING: the local set local_0000010 on node(s) node0" in text and "failed its check while it was read" \
        in text, text[-3000:]

    got = losses(ev)
    assert sorted(got) == list(range(1, ITERS + 1))
    diffs = {s: (v, reference[s]) for s, v in got.items() if any(x != reference[s] for x in v)}
    assert diffs == {}, diffs

    # the report counts the steps each interruption lost and says which tier the next attempt resumed from
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "analysis/report.py", str(run_dir), "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(out / "interruptions.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["attempt"], r["last_step"], r["steps_lost"], r["resumed_tier"]) for r in rows] == [
        ("0", "6", "0", "local"), ("1", "10", "2", "global")]


DP_JOB = ["cluster=local", "model=tiny", "parallelism=tiny", "parallelism.tp=1", "parallelism.distributed_optimizer=true",
          "cluster.nodes=2", "cluster.gpus_per_node=1", "training.train_iters=6", "training.checkpoint_interval=3",
          "training.async_save=false"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_dp_sharded_local_set_rebuilds_the_weights_from_the_main_weights_bitwise(tmp_path, precision):
    """dp 2 over 2 simulated nodes with the distributed optimizer: a shard holds
    this rank's half of the fp32 main weights and Adam moments, not the model's weights. node1 is lost after the local
    set of step 4 (the global checkpoint is of step 3): the next attempt restores node1's half from its replica on
    node0, rebuilds every weight by the all-gather (without ``overlap_param_gather`` nothing else would gather
    them before the first forward pass), and every loss equals the uninterrupted run's, bitwise. fp32: the main
    weights are views of the weights' buffer; bf16: they are fp32 copies, cast back into the bf16 weights first."""
    from safetensors import safe_open

    from launch.planner.tiers import node_shard_bytes

    ref_dir = tmp_path / "ref"
    write_job(ref_dir, [*DP_JOB, f"training.precision={precision}", f"run.dir={ref_dir}"])
    assert run_attempt(ref_dir, 0) == [0] * WORLD, logs(ref_dir)
    reference = {s: v[0] for s, v in losses(read_events(ref_dir / "events.jsonl")).items()}
    assert sorted(reference) == list(range(1, 7))

    run_dir, local_root = tmp_path / "run", tmp_path / "node_local"
    job = write_job(run_dir, [*DP_JOB, f"training.precision={precision}", f"run.dir={run_dir}",
                              "training.local_checkpoint.interval=1",
                              f"cluster.local_checkpoint_dir={local_root}"])
    paths = LocalPaths(local_root, "tiny")
    assert run_attempt(run_dir, 0, fail_at=5) == [1] * WORLD, logs(run_dir)
    saved = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "local_checkpoint_saved"]
    assert [e["step"] for e in saved] == [1, 2, 4]
    with safe_open(str(paths.set_dir("node0", 4) / LocalPaths.shard_files("node0", 0)[0]), "pt") as f:
        names = list(f.keys())
    assert names and not [n for n in names if n.startswith("model")], names  # no weight is saved twice
    # the planner's size of a node's shards (what the check sizes the directory by) is what a save wrote
    assert abs(saved[-1]["bytes"] / node_shard_bytes(job) - 1) < 0.05, (saved[-1]["bytes"], node_shard_bytes(job))
    shutil.rmtree(paths.node_dir("node1"))  # node1 is lost with its local directory

    assert run_attempt(run_dir, 1) == [0] * WORLD, logs(run_dir)
    ev = read_events(run_dir / "events.jsonl")
    assert [(e["tier"], e["step"], e["global_step"], e["lost_steps"]) for e in ev if e["event"] == "resumed_from"] \
        == [("local", 4, 3, 0)]
    assert "on node(s) node0" in [e for e in ev if e["event"] == "resume"][-1]["checkpoint"]
    got = losses(ev)
    diffs = {s: (v, reference[s]) for s, v in got.items() if any(x != reference[s] for x in v)}
    assert sorted(got) == list(range(1, 7)) and diffs == {}, diffs
