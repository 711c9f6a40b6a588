"""The two checkpoint tiers planned together: node-local sets every L steps, global checkpoints every G.

A local save costs a node's own shards written to its local directory plus ``replication - 1`` copies sent to and
written by peers; a global save costs the whole checkpoint at the shared filesystem's bandwidth. Which failures a
local set can serve depends on where the restart runs (docs/recovery.md, "Node-local checkpoints"):

* ``cluster=local``: every restart runs on this machine, so every failure (p = 1);
* Slurm with in-job restart (spares, a relaunch budget): the relaunch stays in the allocation, and a lost node's
  shards come from their replica when ``replication >= 2``; a lost node without a replica (``replication = 1``,
  :data:`NODE_LOSS` of the failures) needs the global tier;
* Slurm without it: a failure is requeued, usually onto other nodes whose directories hold nothing of this run
  (p = 0: the local tier costs saves and saves nothing).

:func:`recovery.interval.two_tier_steps` turns the costs and ``p`` into both intervals; the dry-run summary shows
them beside the configured ones, and ``python -m launch.planner.simulate --tiers`` simulates them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from launch.config import Job
from launch.planner.estimate import checkpoint_bytes
from launch.spares import in_job_enabled
from recovery.interval import job_mtbf_s, two_tier_steps

NODE_LOSS = 0.78  # Llama 3 405B: 78% of the unexpected interruptions were (suspected) hardware, i.e. a lost node


def node_shard_bytes(job: Job) -> float:
    """Bytes of one node's local shards: each rank holds its slice (tp x pp split, and dp too with the distributed
    optimizer) of the fp32 main weights and the two Adam moments, 12 bytes a parameter; the model's weights are
    rebuilt from the main weights at the restore, not saved (``train.local_ckpt``)."""
    p = job.parallelism
    params = checkpoint_bytes(job) / (12.0 if job.training.precision == "fp32" else 14.0)
    optim_split = max(1, p.tp * p.pp) * (max(1, job.dp) if p.distributed_optimizer else 1)
    return params * 12.0 / optim_split * job.cluster.gpus_per_node


def local_save_time_s(job: Job) -> float:
    """Seconds a local save costs, counted as a stall (an upper bound: the ranks stall only for the copy, the rest runs
    on a thread beside training, which on a busy host still slows the steps): a node writes its own shards and the
    ``replication - 1`` replicas it receives at ``cluster.local_write_bandwidth_gbs``, and sends its shards to
    ``replication - 1`` peers at the node's inter-node bandwidth (``ib_bandwidth_gbs`` per GPU)."""
    c, copies = job.cluster, max(1, job.training.local_checkpoint.replication)
    shard = node_shard_bytes(job)
    write = copies * shard / (max(c.local_write_bandwidth_gbs, 1e-9) * 1e9)
    send = (copies - 1) * shard / (max(c.ib_bandwidth_gbs, 1e-9) * max(1, c.gpus_per_node) * 1e9)
    return write + send


def local_share(job: Job) -> tuple[float, str]:
    """(p, why): the share of failures whose restart can resume from a local set."""
    c, copies = job.cluster, job.training.local_checkpoint.replication
    if c.launcher == "local":
        return 1.0, "cluster=local: every restart runs on this machine"
    if not in_job_enabled(job):
        return 0.0, ("no in-job restart (cluster.spare_nodes=0): a failure is requeued, usually onto other nodes "
                     "whose local directories hold nothing of this run")
    if copies < 2:
        return 1.0 - NODE_LOSS, (f"in-job restart, but replication {copies}: a lost node ({100 * NODE_LOSS:.0f}% of "
                                 "failures, Llama 3) takes its only copy with it")
    return 1.0, "in-job restart: relaunches stay in the allocation, a lost node's shards come from their replica"


@dataclass(frozen=True)
class TierPlan:
    """Both tiers for one job: what is configured, what the costs and failure rate recommend, and why."""

    local_save_s: float
    global_save_s: float  # what a global save stalls training
    share: float  # p: failures a local set can serve
    share_why: str
    local_steps: Optional[int]  # configured (training.local_checkpoint.interval)
    global_steps: Optional[int]  # configured or resolved (training.checkpoint_interval)
    best_local: int  # recommended (0: the tier cannot help)
    best_global: Optional[int]  # recommended (None: the failure rate does not bound it)
    reasoning: str


def plan_tiers(job: Job, est: Any) -> Optional[TierPlan]:
    """The two tiers' plan (None: the local tier is off, or no step-time estimate, e.g. ``cluster.gpu=cpu``)."""
    lc, step = job.training.local_checkpoint, getattr(est, "step_time_s", None)
    if not lc.enabled or not step:
        return None
    blocking = (est.breakdown.get("cost") or {}).get("save_blocking_s", est.save_time_s)
    local_s = local_save_time_s(job)
    share, why = local_share(job)
    mtbf = job_mtbf_s(job.cluster.node_mtbf_hours, max(1, job.cluster.nodes))
    best_local, best_global, reasoning = two_tier_steps(local_s, max(blocking, 1e-6), step, mtbf, share)
    return TierPlan(local_save_s=local_s, global_save_s=blocking, share=share, share_why=why,
                    local_steps=lc.interval, global_steps=est.checkpoint_interval, best_local=best_local,
                    best_global=best_global, reasoning=reasoning)


def summary_text(job: Job, est: Any) -> Optional[str]:
    """The dry-run summary's ``local tier`` line: both intervals, configured and recommended, and the costs."""
    lc = job.training.local_checkpoint
    if not lc.enabled:
        return None
    head = f"every {lc.interval} steps to {job.cluster.local_checkpoint_dir or '(no directory)'}, replication " \
           f"{lc.replication}, keep {lc.keep}"
    plan = plan_tiers(job, est) if est is not None else None
    if plan is None:
        return head + " (no step-time estimate: no recommended intervals)"
    glob = f"every {plan.global_steps}" if plan.global_steps else "none periodic"
    best_global = f"every {plan.best_global}" if plan.best_global else "as rare as the stops allow"
    if plan.best_local == 0 and plan.share <= 0:
        best = f"no local tier: {plan.share_why}"
    elif plan.best_local == 0:
        best = (f"no local tier: a local save stalls longer than the global tier alone needs (global every "
                f"{plan.best_global} steps)")
    else:
        best = f"local every {plan.best_local}, global {best_global} (p = {plan.share:.2f}: {plan.share_why})"
    return (f"{head}; local save {plan.local_save_s:.3g} s, global save {plan.global_save_s:.3g} s "
            f"(global {glob}); recommended: {best}")
