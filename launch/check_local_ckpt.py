"""The check's rules for the node-local checkpoint tier (``training.local_checkpoint``, ``cluster.local_checkpoint_dir``;
part of :func:`launch.check.check`).

The space rule: a node's local directory holds ``keep`` committed sets plus the one being written, each with the
node's own shards and the replicas of ``replication - 1`` other nodes, so it needs
``(keep + 1) x replication x`` the bytes of one node's shards (the planner's checkpoint size,
:func:`launch.planner.estimate.checkpoint_bytes`, as the ranks of one node hold it). The free space is probed where
the directory is (``cluster=local``: on this machine); on Slurm the directory is on the compute nodes, which a login
node cannot see, so only the arithmetic is shown by the dry run. The probe is injected (``free_bytes``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

from launch.config import Job
from launch.paths import RunDirError, resolved, run_dir_for, system_dir_issue
from launch.planner.tiers import node_shard_bytes
from launch.problems import Problem
from recovery.storage import size_text

F = "training.local_checkpoint."


def probe_free_bytes(path: str) -> Optional[int]:
    """Bytes free to this user where ``path`` is (or would be created: its nearest existing parent); None if unknown."""
    p = Path(os.path.abspath(os.path.expanduser(path)))
    for candidate in (p, *p.parents):
        if candidate.exists():
            try:
                st = os.statvfs(candidate)
            except OSError:
                return None
            return st.f_bavail * st.f_frsize
    return None


def needed_bytes(job: Job) -> float:
    """What a node's local directory must hold: (keep + 1 being written) x replication x one node's shards."""
    lc = job.training.local_checkpoint
    return (lc.keep + 1) * max(1, lc.replication) * node_shard_bytes(job)


def local_plan(job: Job) -> dict:
    """What ``local_plan.json`` holds: the space arithmetic of one node's local directory."""
    lc, shard = job.training.local_checkpoint, node_shard_bytes(job)
    need = needed_bytes(job)
    return {"node_shard_bytes": shard, "needed_bytes": need, "keep": lc.keep, "replication": lc.replication,
            "arithmetic": f"(keep {lc.keep} + 1 being written) x replication {lc.replication} x {size_text(shard)} per "
                          f"node = {size_text(need)}"}


def local_dir_issue(job: Job) -> Optional[str]:
    """Why ``cluster.local_checkpoint_dir`` cannot hold this run's node-local sets: it is ``/`` or a shared system
    directory (a shared ``/dev/shm`` itself), the run directory, or inside it or inside the run root (where other
    runs live). None when it can."""
    local = job.cluster.local_checkpoint_dir
    system = system_dir_issue(local, "cluster.local_checkpoint_dir")
    if system:
        return system
    where = resolved(local)
    try:
        owners = [(run_dir_for(job.cluster.run_root, job.run.name, job.run.dir), "the run directory")]
    except RunDirError:  # refused by the run-directory rule: its own problem says so
        owners = []
    for owner, what in owners + [(resolved(job.cluster.run_root), "cluster.run_root")]:
        if where == owner or owner in where.parents:
            return f"cluster.local_checkpoint_dir = {local!r} is {what} or inside it ({owner})"
    return None


def problems(job: Job, free_bytes: Callable[[str], Optional[int]] = probe_free_bytes) -> list[Problem]:
    """Every problem of the local tier's settings (empty when it is off and its fields are well-formed)."""
    lc, c = job.training.local_checkpoint, job.cluster
    out: list[Problem] = []
    iv = lc.interval
    if iv is not None and (not isinstance(iv, int) or isinstance(iv, bool) or iv < 0):
        out.append(Problem(f"{F}interval", "must be a step count >= 0 (0 or null = no local checkpoints)",
                           f"interval = {iv!r}", f"set {F}interval=5 (or 0 for off)"))
        return out
    if lc.keep not in (1, 2):
        out.append(Problem(f"{F}keep", "a node keeps 1 or 2 committed local sets", f"keep = {lc.keep!r}",
                           f"set {F}keep=1"))
    if not isinstance(lc.replication, int) or lc.replication < 1:
        out.append(Problem(f"{F}replication", "copies of each node's shards: its own plus replication - 1 peers",
                           f"replication = {lc.replication!r} < 1", f"set {F}replication=2"))
    if not lc.enabled:
        return out
    if not c.local_checkpoint_dir.strip():
        out.append(Problem("cluster.local_checkpoint_dir", "the local tier needs a node-local directory",
                           f"{F}interval = {iv} with cluster.local_checkpoint_dir = ''",
                           "set cluster.local_checkpoint_dir=/dev/shm/slurmtron (or a local NVMe path)"))
    elif (where := local_dir_issue(job)) is not None:
        out.append(Problem("cluster.local_checkpoint_dir", "not a node-local directory of the run's own", where,
                           "set cluster.local_checkpoint_dir=/dev/shm/slurmtron (or a local NVMe path)"))
    if isinstance(lc.replication, int) and lc.replication > max(1, c.nodes):
        out.append(Problem(
            f"{F}replication", "each copy of a node's shards must be on a different node",
            f"replication {lc.replication} > cluster.nodes {c.nodes}",
            f"set {F}replication={max(1, c.nodes)}" + (" (one node: no peer holds a copy, a lost node loses its "
                                                       "local sets) or cluster.nodes=2" if c.nodes <= 1 else "")))
    fixed = job.training.fixed_checkpoint_interval
    if fixed is not None and iv >= fixed:
        out.append(Problem(f"{F}interval", "local saves only help between the global ones",
                           f"interval {iv} >= training.checkpoint_interval {fixed}",
                           f"set {F}interval below {fixed} (e.g. {max(1, fixed // 5)})"))
    if out or c.launcher != "local" or not c.local_checkpoint_dir.strip():
        return out
    free = free_bytes(c.local_checkpoint_dir)
    need = needed_bytes(job)
    if free is not None and free < need:
        out.append(Problem(
            "cluster.local_checkpoint_dir", "too small for the local sets of one node",
            f"free {size_text(free)} < (keep {lc.keep} + 1 being written) x replication {lc.replication} x "
            f"{size_text(node_shard_bytes(job))} per node = {size_text(need)}",
            f"free space there, choose a larger node-local directory, or lower {F}replication / {F}keep"))
    return out
