"""Spare nodes for in-job restart (``cluster.spare_nodes``, ``cluster.in_job_restarts``): the check's rules and
the dry-run summary's line (what the spares cost, what they save at ``cluster.node_mtbf_hours``).

With ``spare_nodes > 0`` the job asks Slurm for ``nodes + spare_nodes`` nodes with ``--no-kill`` and trains on
``nodes`` of them; after a crash, a hang or a lost node the batch script starts a new ``srun`` step on healthy
nodes of the same allocation (:mod:`recovery.injob`), at most ``in_job_restarts`` times, then takes the requeue
path. The saving is simulated (:func:`launch.planner.simulate.simulate_recovery`): the requeue path with an
assumed queue wait against in-job restart, on the same failure draws.
"""
from __future__ import annotations

from typing import Any, Optional

from launch.config import Job
from launch.problems import Problem

QUEUE_WAIT_MIN = 10.0  # the queue wait the summary assumes for a requeue (a busy cluster: minutes to hours)
REQUEUE_MIN = 10.0  # the requeue path without the queue: Slurm's requeue delay, prologue, start-up, load
IN_JOB_MIN = 5.0  # in the allocation: detection, health check, start-up, load


def in_job_enabled(job: Job) -> bool:
    """Whether the rendered script relaunches inside the allocation (spares, a budget, Slurm, crash retries on)."""
    c = job.cluster
    return (c.launcher == "slurm" and c.spare_nodes > 0 and c.in_job_restarts > 0
            and job.training.requeue_on_crash)


def problems(job: Job) -> list[Problem]:
    """The spares' and the in-job budget's own rules (every problem at once)."""
    c = job.cluster
    out = []
    if c.spare_nodes < 0:
        out.append(Problem("cluster.spare_nodes", "must be >= 0 (0 = no spares: every failure is requeued)",
                           f"spare_nodes = {c.spare_nodes}", "set cluster.spare_nodes=0 or 1"))
    if c.in_job_restarts < 0:
        out.append(Problem("cluster.in_job_restarts", "must be >= 0 (0 = no relaunch inside the allocation)",
                           f"in_job_restarts = {c.in_job_restarts}", "set cluster.in_job_restarts=3"))
    if c.spare_nodes > 0 and c.launcher == "local":
        out.append(Problem("cluster.spare_nodes", "spare nodes are nodes of a Slurm allocation",
                           f"spare_nodes {c.spare_nodes} with cluster.launcher=local",
                           "set cluster.spare_nodes=0 (the local launcher relaunches on this machine)"))
    return out


def summary_text(job: Job, est: Any = None) -> Optional[str]:
    """``1 spare of 3 nodes (--no-kill), 3 in-job restarts; idle: 2 GPUs x 1.5 h = 3 GPU-hours (+50%); ...``."""
    c = job.cluster
    if c.spare_nodes <= 0:
        return None
    gpus = c.spare_nodes * max(1, c.gpus_per_node)
    what = "processes" if c.gpu == "cpu" else "GPUs"
    text = (f"{c.spare_nodes} spare node{'s' if c.spare_nodes > 1 else ''} of {c.nodes + c.spare_nodes} "
            f"(--no-kill), {c.in_job_restarts} in-job restart{'s' if c.in_job_restarts != 1 else ''} per allocation")
    if not in_job_enabled(job):
        text += " (off: training.requeue_on_crash=false or cluster.in_job_restarts=0)"
    wall_h = getattr(est, "wall_time_h_total", None) if est is not None else None
    if wall_h:
        one = "GPU" if what == "GPUs" else "process"
        text += (f"; idle {gpus} {what} x {wall_h:,.3g} h = {gpus * wall_h:,.4g} {one}"
                 f"-hours (+{100 * c.spare_nodes / c.nodes:.0f}%)")
        saved = saving_h(job, est)
        if saved is not None:
            text += (f"; at node MTBF {c.node_mtbf_hours:,.0f} h they save {saved:,.3g} h of wall time against "
                     f"requeues with a {QUEUE_WAIT_MIN:g} min queue (simulated)")
    return text


def saving_h(job: Job, est: Any, *, trials: int = 200) -> Optional[float]:
    """Expected wall hours in-job restart saves over the requeue path for this job (None: no estimate)."""
    from launch.planner.simulate import Recovery, Scenario, simulate_recovery  # numpy: kept off the dry run

    c = job.cluster
    wall_h = getattr(est, "wall_time_h_total", None)
    step_s = getattr(est, "step_time_s", None)
    if not wall_h or not step_s or c.node_mtbf_hours <= 0 or c.nodes < 1:
        return None
    every = getattr(est, "checkpoint_interval", None) or job.training.fixed_checkpoint_interval or 1000
    s = Scenario(work_h=wall_h, nodes=c.nodes, gpus_per_node=max(1, c.gpus_per_node), node_mtbf_h=c.node_mtbf_hours,
                 save_h=(getattr(est, "save_time_s", 0.0) or 0.0) / 3600, restart_h=REQUEUE_MIN / 60)
    interval_h = max(every * step_s / 3600, 1e-6)
    base = Recovery("requeue", queue_wait_h=QUEUE_WAIT_MIN / 60, requeue_h=REQUEUE_MIN / 60)
    spare = Recovery("in-job", queue_wait_h=QUEUE_WAIT_MIN / 60, requeue_h=REQUEUE_MIN / 60, in_job_h=IN_JOB_MIN / 60,
                     spares=c.spare_nodes, in_job_restarts=max(0, c.in_job_restarts))
    a = simulate_recovery(s, interval_h, base, trials=trials)
    b = simulate_recovery(s, interval_h, spare, trials=trials)
    return a.wall_h_mean - b.wall_h_mean
