"""End to end on the local Slurm cluster: the real entry point, real Megatron-Core training.

Each scenario submits with ``python launch/pretrain.py cluster=slurm_local ...`` (a subprocess,
as a user would), the rendered script runs ``python -m train.worker`` on 2 nodes x 1 task
(PP2, one stage per node, gloo on the CPU), and the scenario then does to the job what a real
cluster does: a time limit, a node set DOWN, a node that dies, a preempting job, a crash
loop. Every test asserts what Slurm reports (``sacct -D`` states, ``Restarts``, the job id)
*and* the training outcome (the last step reached, losses equal to an uninterrupted run).

The scenarios are independent (distinct run directories; each job fills its 2 nodes' CPUs,
so two jobs never share a node), so they run two at a time in threads (the machine has 2
cores; with three at a time the scancel scenario's stop checkpoint missed the 5 s KillWait once
in CI-like load). Beside them a light lane runs,
also two at a time, the scenarios that mostly wait (a start-up that sleeps past its slice,
one-rank runs that sleep through their steps) on the cluster's other nodes, once the
time-limit scenario has ended (its rerun must fit a 3-minute slice). Tests wait on
their scenario's result; the actions live in the scenarios, the assertions in the tests.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

import pytest

from recovery.events import read_events
from slurm_cluster import Cluster, wait_until

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
ITERS = 20  # the tiny recipe: 20 steps, checkpoint every 10
PAIR = ("cluster.gpus_per_node=1", "parallelism=pp2")  # 2 nodes x 1 rank, a pipeline stage each: what a scenario
# does to a node reaches a whole stage, and a job starts 2 ranks, not 4 (the start-ups are most of the lane's CPU)
SLEEP = "+cluster.env.SLURMTRON_TEST_STEP_SLEEP_S"  # worker test hook: seconds slept per step
FAIL_AT = "+cluster.env.SLURMTRON_TEST_FAIL_AT_ITER"  # worker test hook: crash at this iteration
TRAIN_TIMEOUT = 600  # one scenario, start to finish, on a loaded 2-core machine (the time-limit one: a 3-minute
# slice, then the rerun, took 301 s with the light lane's start-ups beside it)

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1500)]


# ----------------------------------------------------------------------------- helpers


def pretrain(cluster: Cluster, cwd: Path, *overrides: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The real front door, as a user runs it (a subprocess; sbatch sees this cluster's SLURM_CONF)."""
    flags = [o for o in overrides if o.startswith("-")]  # Hydra wants -m before the overrides
    cmd = [PY, str(REPO / "launch" / "pretrain.py"), *flags, "cluster=slurm_local", f"cluster.python={PY}",
           *(o for o in overrides if not o.startswith("-"))]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=cluster.env, cwd=cwd)


@dataclass
class Run:
    """One submitted run: its directory and Slurm job id, plus what the scenario observed."""

    dir: Path
    job_id: str
    seen: Dict[str, object] = field(default_factory=dict)  # scenario notes (node killed, preemptor id, ...)
    final: str = ""  # sacct's final state of the job
    sacct: List[Dict[str, str]] = field(default_factory=list)  # sacct -D -X rows, oldest first
    restarts: int = -1  # scontrol's Restarts

    def events(self) -> List[dict]:
        return read_events(self.dir / "events.jsonl")  # tolerates a line being written

    def of(self, kind: str) -> List[dict]:
        return [e for e in self.events() if e.get("event") == kind]

    def losses(self) -> Dict[int, str]:
        """Loss per step, the *last* time the step ran (a resumed run recomputes some steps)."""
        return {e["step"]: e["loss"] for e in self.of("iteration")}

    def step_reached(self) -> int:
        return max((e["step"] for e in self.of("iteration")), default=0)

    def logs(self, tail: int = 40) -> str:
        """The batch log and the tails of the rank logs: the message of a failed assertion."""
        parts = []
        for f in sorted((self.dir / "logs").glob("*.out")):
            lines = [x for x in f.read_text(errors="replace").splitlines()
                     if "warn" not in x.lower() and not x.startswith("  ")]  # no warning noise
            parts.append(f"--- {f.name}\n" + "\n".join(lines[-tail:]))
        ev = [json.dumps(e)[:300] for e in self.events() if e.get("event") != "iteration"]
        return "\n".join(parts + ["--- events (no iterations)"] + ev)


def submit(cluster: Cluster, run_dir: Path, *overrides: str) -> Run:
    """Submit one run through pretrain.py; the job id comes from the run's submissions.jsonl."""
    res = pretrain(cluster, run_dir.parent, f"run.dir={run_dir}", f"run.name={run_dir.name}", *overrides)
    assert res.returncode == 0, f"pretrain.py exited {res.returncode}\n{res.stdout}\n{res.stderr}"
    subs = [json.loads(x) for x in (run_dir / "submissions.jsonl").read_text().splitlines()]
    return Run(run_dir, subs[-1]["job_id"])


def wait_step(run: Run, step: int, timeout: float = TRAIN_TIMEOUT) -> None:
    """Until the run has logged ``step`` (training is really under way, a checkpoint may exist)."""
    wait_until(lambda: run.step_reached() >= step, timeout, f"job {run.job_id} to reach step {step}", interval=1)


def wait_committed(run: Run, step: int, timeout: float = 120) -> None:
    """Until the checkpoint of ``step`` is committed (an asynchronous save commits a few steps after it starts)."""
    wait_until(lambda: step in [e["step"] for e in run.of("checkpoint_saved")], timeout,
               f"job {run.job_id} to commit the step-{step} checkpoint", interval=0.5)


def finish(cluster: Cluster, run: Run, timeout: float = TRAIN_TIMEOUT) -> Run:
    """Wait for the job's end and collect what Slurm says about it."""
    run.final = cluster.wait_end(run.job_id, timeout)
    run.restarts = int(cluster.job(run.job_id).get("Restarts", "-1"))
    run.sacct = cluster.sacct(run.job_id)
    return run


def states(run: Run) -> List[str]:
    """The allocation's state per attempt, oldest first (``sacct -D``)."""
    return [r["State"].split()[0] for r in run.sacct]


def other_node(cluster: Cluster, run: Run) -> str:
    """The job's second node (rank 0, which writes events, stays on the first)."""
    nodes = cluster.hostnames(cluster.job(run.job_id)["NodeList"])
    assert len(nodes) == 2, nodes
    return nodes[1]


# ----------------------------------------------------------------------------- scenarios


def completes(cluster: Cluster, d: Path) -> Run:
    """Uninterrupted PP2: the reference losses for the time-limit test."""
    return finish(cluster, submit(cluster, d / "ref", *PAIR, "run.time_limit_min=10"))


def time_limit(cluster: Cluster, d: Path) -> Run:
    """--time=3 with a 30 s lead: USR2 arrives 30-60 s before the limit (120-150 s in), mid-run.

    Checkpoints every 5 steps, so the warning lands after a periodic save, as in production
    (the save machinery's helper processes are alive and get the signal too).

    The first attempt sleeps 8 s per step (20 steps never fit before the warning); the rerun
    does not sleep (a cluster.setup line reads SLURM_RESTART_COUNT), so even with a slow
    start-up it finishes long before its own warning and the run needs exactly one requeue.
    """
    slow_first = "cluster.setup=['[ -n \"$SLURM_RESTART_COUNT\" ] || export SLURMTRON_TEST_STEP_SLEEP_S=8']"
    run = submit(cluster, d / "timelimit", *PAIR, "run.time_limit_min=3",
                 "training.signal_lead_time_s=30", "training.checkpoint_interval=5", slow_first)
    return finish(cluster, run)


def node_down(cluster: Cluster, d: Path) -> Run:
    """PP2; after the step-10 checkpoint an admin sets one of its nodes DOWN."""
    run = submit(cluster, d / "nodedown", *PAIR, "run.time_limit_min=10", f"{SLEEP}=1")
    wait_step(run, 12)
    wait_committed(run, 10)
    node = other_node(cluster, run)
    run.seen["node"] = node
    run.seen["ckpt_steps_before"] = [e["step"] for e in run.of("checkpoint_saved")]
    cluster.run("scontrol", "update", f"nodename={node}", "state=down", "reason=slurmtron-test")
    try:
        wait_until(lambda: len(cluster.sacct(run.job_id)) >= 2, 120, f"job {run.job_id} to be requeued", interval=1)
    finally:  # ReturnToService=2 usually has it back already (its slurmd answers); if not, resume it
        cluster.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
    wait_until(lambda: cluster.in_service(node), 120, f"{node} back in service")
    return finish(cluster, run)


def node_crash(cluster: Cluster, d: Path) -> Run:
    """PP2; after the step-10 checkpoint one node dies (its slurmd and its rank SIGKILLed)."""
    run = submit(cluster, d / "nodecrash", *PAIR, "run.time_limit_min=10", f"{SLEEP}=1")
    wait_step(run, 12)
    wait_committed(run, 10)
    node = other_node(cluster, run)
    run.seen["node"] = node
    run.seen["ckpt_steps_before"] = [e["step"] for e in run.of("checkpoint_saved")]
    run.seen["killed"] = cluster.crash_node(node)
    try:
        wait_until(lambda: cluster.node_state(node).startswith("down"), 120, f"{node} to be marked down", interval=1)
        # the node comes back only once the job runs elsewhere: the controller still holds a
        # kill request for the dead node's old attempt and delivers it when slurmd answers
        wait_until(lambda: cluster.job(run.job_id).get("Restarts") == "1" and cluster.state(run.job_id) == "RUNNING",
                   180, f"job {run.job_id} to run again", interval=1)
    finally:
        cluster.restart_slurmd(node)
    wait_until(lambda: cluster.in_service(node), 120, f"{node} back in service")
    return finish(cluster, run)


def preemption(cluster: Cluster, d: Path) -> Run:
    """PP2 in the preemptible partition; an 'urgent' job takes one of its nodes mid-run."""
    run = submit(cluster, d / "preempt", *PAIR, "run.time_limit_min=10", f"{SLEEP}=1")
    wait_step(run, 12)  # after the step-10 checkpoint: SIGTERM also reaches the save machinery's helpers
    node = other_node(cluster, run)
    urgent = cluster.run("sbatch", "--parsable", "-p", cluster.spec.urgent_partition, "-w", node, "--exclusive",
                         "-J", "urgent", f"--chdir={d}", f"--output={d}/urgent_%j.out", "--wrap", "sleep 5")
    run.seen["preemptor"] = urgent.stdout.strip()
    run.seen["preempted_at"] = time.time()
    finish(cluster, run)
    run.seen["preemptor_state"] = cluster.wait_end(str(run.seen["preemptor"]), 60)
    return run


def preempted_at_start(cluster: Cluster, d: Path) -> Run:
    """Preempted before its first step (big models spend minutes building): requeue, complete.

    The trigger is rank 0's start record (progress.json): every rank has installed its
    signal handlers by then (they do so before the process group forms).
    """
    run = submit(cluster, d / "earlypreempt", *PAIR, "run.time_limit_min=10")
    wait_until(lambda: (run.dir / "progress.json").exists(), TRAIN_TIMEOUT, f"job {run.job_id} to start", interval=0.5)
    node = other_node(cluster, run)
    urgent = cluster.run("sbatch", "--parsable", "-p", cluster.spec.urgent_partition, "-w", node, "--exclusive",
                         "-J", "urgent", f"--chdir={d}", f"--output={d}/urgent_%j.out", "--wrap", "sleep 5")
    run.seen["preemptor"] = urgent.stdout.strip()
    return finish(cluster, run)


def crash_loop(cluster: Cluster, d: Path) -> Run:
    """SLURMTRON_TEST_FAIL_AT_ITER=3 (exported by the batch script): every step crashes at the same iteration.

    With 1 spare and cluster.in_job_restarts=1 the first crash is relaunched in the job; the second finds the
    budget spent and takes the requeue path (recovery/crash.py's judgement and requeue, as without spares); the
    requeued attempt's step is refused by the zero-progress guard, which must end the loop that a deterministic
    crash would otherwise make endless. (The crash requeue of a job without spares is the hang scenario's.)
    """
    run = submit(cluster, d / "crashloop", *PAIR, "run.time_limit_min=10", f"{FAIL_AT}=3",
                 "training.zero_progress_restarts=2", "cluster.spare_nodes=1", "cluster.in_job_restarts=1")
    return finish(cluster, run, timeout=2 * TRAIN_TIMEOUT)


def no_megatron(cluster: Cluster, d: Path) -> Run:
    """Megatron-Core unimportable on every node: a PYTHONPATH directory (exported by the batch script, ahead of the
    code directory) whose ``megatron.core`` raises ModuleNotFoundError. Each attempt fails before its first step
    (recorded under startup/), the batch script requeues it (recovery/crash.py), and the start-up rule refuses the
    attempt after training.zero_progress_restarts of them: exit 3, final, no further requeue."""
    broken = d / "nomegatron_site"
    (broken / "megatron" / "core").mkdir(parents=True)
    (broken / "megatron" / "__init__.py").write_text("")
    (broken / "megatron" / "core" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'megatron.core'\", name='megatron.core')\n")
    run = submit(cluster, d / "nomegatron", *PAIR, "run.time_limit_min=10", "training.zero_progress_restarts=2",
                 f"+cluster.env.PYTHONPATH={broken}:{REPO}")
    return finish(cluster, run)


def rank_pid(job_id: str, procid: int) -> Optional[int]:
    """The pid of the training rank (not its watcher) with this job id and SLURM_PROCID, from /proc."""
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
            env = dict(x.split(b"=", 1) for x in (p / "environ").read_bytes().split(b"\0") if b"=" in x)
        except OSError:
            continue
        if b"train.worker" in cmd and env.get(b"SLURM_JOB_ID") == job_id.encode() \
                and env.get(b"SLURM_PROCID") == str(procid).encode():
            return int(p.name)
    return None


def rank_node(pid: int) -> str:
    """The Slurm node a rank runs on (its SLURMD_NODENAME)."""
    env = dict(x.split(b"=", 1) for x in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in x)
    return env[b"SLURMD_NODENAME"].decode()


def hang(cluster: Cluster, d: Path) -> Run:
    """PP2, 1 s per step; after the step-10 checkpoint rank 1 is SIGSTOPped (no signal, no exit).

    The hang watchdog must notice (step deadline max(5 x median, 10 s)), dump every rank's
    stacks, name rank 1 the suspect, end the attempt; the batch script requeues it
    (recovery/crash.py) and the rerun resumes from step 10.
    """
    import os
    import signal

    run = submit(cluster, d / "hang", *PAIR, "run.time_limit_min=10", f"{SLEEP}=1",
                 "training.watchdog.step_floor_s=10")
    wait_step(run, 12)
    wait_committed(run, 10)  # asynchronous: a write still in flight at the SIGSTOP would never be committed
    pid = rank_pid(run.job_id, 1)
    assert pid, run.logs()
    os.kill(pid, signal.SIGSTOP)
    run.seen["stopped_at"] = time.time()
    return finish(cluster, run)


def sweep(cluster: Cluster, d: Path) -> Dict[str, object]:
    """A Hydra multirun over 3 layouts (tp=1, 2, 4 on 2 x 2 ranks); tp=4 > 2 ranks per node is invalid."""
    root = d / "runs"
    t0 = time.monotonic()
    res = pretrain(cluster, d, "-m", "parallelism.tp=1,2,4", f"cluster.run_root={root}", "run.name=sweep",
                   "run.time_limit_min=10", f"{SLEEP}=2")
    took = time.monotonic() - t0
    registry = sorted((root / "sweeps").glob("*.jsonl")) if (root / "sweeps").exists() else []
    entries = [json.loads(x) for f in registry for x in f.read_text().splitlines()]
    live = {e["job_id"]: cluster.state(e["job_id"]) for e in entries if e.get("job_id")}
    for job_id in live:  # detach was the point; the training itself is covered by the other scenarios
        cluster.run("scancel", job_id)
    ended = {job_id: cluster.wait_end(job_id, 60) for job_id in live}
    return {"res": res, "took": took, "registry": registry, "entries": entries, "live": live, "ended": ended}


def user_cancel(cluster: Cluster, d: Path) -> Run:
    """PP2; after the step-10 checkpoint the user runs ``scancel <jobid>``."""
    run = submit(cluster, d / "cancel", *PAIR, "run.time_limit_min=10", f"{SLEEP}=0.5")
    wait_step(run, 12)
    # the step-10 save durable first: its asynchronous write is not this test's subject (the async_requeue scenario),
    # and waiting for it inside the 5 s KillWait would leave less for the stop checkpoint on a loaded machine
    wait_committed(run, 10)
    run.seen["cancelled_at"] = time.time()
    cluster.run("scancel", run.job_id)
    return finish(cluster, run)


def drain(cluster: Cluster, d: Path) -> Run:
    """PP2; after step 12 the user drains the run with launch/stop.py; then resubmits it."""
    run_dir = d / "drain"
    run = submit(cluster, run_dir, *PAIR, "run.time_limit_min=10", f"{SLEEP}=1")
    wait_step(run, 12)
    stop = subprocess.run([PY, str(REPO / "launch" / "stop.py"), "cluster=slurm_local", f"run.dir={run_dir}",
                           f"run.name={run_dir.name}"], capture_output=True, text=True, timeout=60, env=cluster.env)
    run.seen["stop_cmd"] = stop
    finish(cluster, run)
    run.seen["stop_file"] = json.loads((run_dir / "stop.json").read_text()) if (run_dir / "stop.json").exists() else None
    run.seen["status"] = subprocess.run([PY, str(REPO / "launch" / "status.py"), str(run_dir)], capture_output=True,
                                        text=True, timeout=120, env=cluster.env)
    again = submit(cluster, run_dir, *PAIR, "run.time_limit_min=10")
    run.seen["again"] = finish(cluster, again)
    return run


def user_requeue(cluster: Cluster, d: Path) -> Run:
    """PP2; after the step-10 checkpoint the user asks for "checkpoint and requeue now"."""
    run = submit(cluster, d / "requeuenow", *PAIR, "run.time_limit_min=10", f"{SLEEP}=1")
    wait_step(run, 12)
    cluster.run("scancel", "--signal=USR2", run.job_id)
    return finish(cluster, run)


def admin_requeue(cluster: Cluster, d: Path) -> Run:
    """PP2; after step 12 an admin (or the user) runs ``scontrol requeue <jobid>``."""
    run = submit(cluster, d / "adminrequeue", *PAIR, "run.time_limit_min=10", f"{SLEEP}=1")
    wait_step(run, 12)
    cluster.run("scontrol", "requeue", run.job_id)
    return finish(cluster, run)


def slow_cancel(cluster: Cluster, d: Path) -> Run:
    """A ``scancel`` whose stop save is made slower than the cluster's KillWait (5 s): the ranks are killed while
    saving; the report must still name the cancel."""
    run = submit(cluster, d / "slowcancel", *PAIR, "run.time_limit_min=10", f"{SLEEP}=1",
                 "+cluster.env.SLURMTRON_TEST_SAVE_SLEEP_S=20", "training.checkpoint_interval=100")
    wait_step(run, 4)
    cluster.run("scancel", run.job_id)
    return finish(cluster, run)


def in_job(cluster: Cluster, d: Path) -> Run:
    """In-job restart: 4 nodes (2 + 2 spares, --no-kill), PP2, 1 s per step, a checkpoint every 5 steps.

    After the step-5 checkpoint rank 1 is SIGKILLed (a crash: relaunched in the job on the same nodes); after the
    relaunch's step-10 checkpoint the step's second node dies (its slurmd and its rank SIGKILLed): the job goes
    on with a spare; after that step's step-15 checkpoint rank 1 (on the spare) is SIGSTOPped (a hang): the
    watchdog ends the step and the job goes on with the last spare instead of the suspect's node. All under the
    same job id, without a requeue (cluster.in_job_restarts=3: all three used).

    With the node-local tier on (a set every step in each node's directory, <d>/local/<node>/, replicated to the other
    node): each relaunch resumes from the newest local set, not the global checkpoint of 5 steps before; the lost
    node's and the suspect's shards come from their replicas on the node that stays."""
    import os
    import signal

    run = submit(cluster, d / "injob", *PAIR, "run.time_limit_min=10", f"{SLEEP}=1",
                 "cluster.spare_nodes=2", "training.checkpoint_interval=5", "training.watchdog.step_floor_s=10",
                 "training.local_checkpoint.interval=1", f"cluster.local_checkpoint_dir={d / 'local'}")
    wait_step(run, 7)
    wait_committed(run, 5)
    pid = rank_pid(run.job_id, 1)
    assert pid, run.logs()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: run.of("in_job_restart"), TRAIN_TIMEOUT, f"job {run.job_id} to relaunch in the job", interval=1)
    wait_until(lambda: any(e["step"] >= 12 and e["restart_count"] == 1 for e in run.of("iteration")), TRAIN_TIMEOUT,
               f"job {run.job_id} to reach step 12 after the relaunch", interval=1)
    wait_committed(run, 10)
    node = run.of("in_job_restart")[-1]["nodes"][1]
    run.seen["node"] = node
    run.seen["killed"] = cluster.crash_node(node)
    try:  # the node stays dead until the job ends, as a failed node does
        wait_until(lambda: len(run.of("in_job_restart")) >= 2, TRAIN_TIMEOUT,
                   f"job {run.job_id} to go on without {node}", interval=1)
        wait_until(lambda: any(e["step"] >= 17 and e["restart_count"] == 2 for e in run.of("iteration")),
                   TRAIN_TIMEOUT, f"job {run.job_id} to reach step 17 on the spare", interval=1)
        wait_committed(run, 15)
        pid = rank_pid(run.job_id, 1)
        assert pid, run.logs()
        os.kill(pid, signal.SIGSTOP)
        run.seen["stopped_on"] = rank_node(pid)
        finish(cluster, run, timeout=2 * TRAIN_TIMEOUT)
    finally:
        cluster.restart_slurmd(node)  # back in service by the module's end (the scenarios fixture waits for it)
    return run


BUDGET_WALL_S = 90  # the budget of the one-rank budget job, in seconds of its allocation (start-up included)


def budget(cluster: Cluster, d: Path) -> Run:
    """One rank (1 node x 1 task), 1 s per step, far more steps than fit a budget of 90 process-seconds: Slurm's
    accounting of the allocation (start-up included) reaches the budget mid-run; the ranks stop at a step boundary
    with a verified checkpoint and exit 17 (final: not requeued). The same command again is refused at submit."""
    over = ["cluster.nodes=1", "cluster.gpus_per_node=1", "parallelism=tp1", "run.time_limit_min=10", f"{SLEEP}=1",
            "training.train_iters=1000", "training.checkpoint_interval=1000",
            f"run.budget_gpu_hours={BUDGET_WALL_S / 3600!r}"]
    run = finish(cluster, submit(cluster, d / "budget", *over))
    run.seen["exit_code"] = [r["ExitCode"] for r in run.sacct]
    run.seen["again"] = pretrain(cluster, d, f"run.dir={run.dir}", f"run.name={run.dir.name}", *over)
    run.seen["jobs_after"] = cluster.run("squeue", "-h", "-n", run.dir.name, "-o", "%i").stdout.split()
    return run


def slow_start(cluster: Cluster, d: Path) -> Run:
    """One rank; the first slice's start-up is made (test hook) to outlast its 3-minute slice, so the time-limit warning
    arrives before any step; rank 0 requeues at once without saving, and the next slice trains the run to the end.
    Without that, the slice would end TIMEOUT, which ``--requeue`` does not requeue: the run would stop silently."""
    slow_first = ("cluster.setup=['[ -n \"$SLURM_RESTART_COUNT\" ] || "
                  "export SLURMTRON_TEST_STARTUP_SLEEP_S=400']")  # longer than the 180 s slice
    return finish(cluster, submit(cluster, d / "slowstart", "cluster.nodes=1", "cluster.gpus_per_node=1",
                                  "parallelism=tp1", "run.time_limit_min=3", "training.signal_lead_time_s=30",
                                  slow_first), timeout=600)


SLICE_ITERS = 20  # at 2 s a step, more than one 1-minute slice holds (start-up + signal lead take the rest)


def slices(cluster: Cluster, d: Path) -> Run:
    """One rank, a 1-minute time limit, 2 s per step, checkpoints only at stops: the run reaches its step over
    several slices, each carried by the warning signal's save (``--signal=USR2@lead``) and rank 0's requeue.
    zero_progress_restarts=8: on a loaded machine a slice can spend its minute starting up (seen 5 times in one run
    beside three trainings; the guard has its own tests). A hang deadline of 20 s fits the 45 s a slice trains before its warning (the check refuses more)."""
    return finish(cluster, submit(cluster, d / "slices", "cluster.nodes=1", "cluster.gpus_per_node=1",
                                  "parallelism=tp1", "run.time_limit_min=1", "training.signal_lead_time_s=15",
                                  f"training.train_iters={SLICE_ITERS}", "training.checkpoint_interval=1000",
                                  "training.zero_progress_restarts=8", "training.watchdog.step_floor_s=20",
                                  f"{SLEEP}=2"), timeout=900)


ASYNC_ITERS = 10


def async_requeue(cluster: Cluster, d: Path) -> Run:
    """One node x 2 ranks with asynchronous saves; while the first save is in flight the user asks for "checkpoint
    and requeue now". The writers wait 8 s: the USR2 must reach the ranks (scancel, slurmctld, slurmd, slurmstepd)
    and be agreed at a step boundary while the save is still in flight, also on a loaded machine where each hop
    takes seconds."""
    run = submit(cluster, d / "asyncstop", "cluster.nodes=1", "run.time_limit_min=5", "training.async_save=true",
                 f"training.train_iters={ASYNC_ITERS}", "training.checkpoint_interval=3", f"{SLEEP}=1",
                 "+cluster.env.SLURMTRON_TEST_ASYNC_WRITE_SLEEP_S=8")
    wait_until(lambda: bool(run.of("checkpoint_async_started")), TRAIN_TIMEOUT,
               f"job {run.job_id} to start an asynchronous save", interval=0.3)
    cluster.run("scancel", "--signal=USR2", run.job_id)
    return finish(cluster, run)


def status_json(cluster: Cluster, run_dir: Path) -> dict:
    proc = subprocess.run([PY, str(REPO / "launch" / "status.py"), str(run_dir), "--json"], capture_output=True,
                          text=True, timeout=120, env=cluster.env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout)


def watched(cluster: Cluster, d: Path) -> Run:
    """``launch/status.py`` follows one tiny run: pending (held by ``--begin``), running, then completed, through
    the same command a user types."""
    run = submit(cluster, d / "watched", *PAIR, "run.time_limit_min=10",
                 "+cluster.sbatch_extra.begin=now+1hour", f"{SLEEP}=0.5", "cluster.gpu_hour_price=3")
    run.seen["pending"] = status_json(cluster, run.dir)
    cluster.run("scontrol", "update", f"JobId={run.job_id}", "StartTime=now")
    seen: dict = {}

    def running_with_steps() -> bool:
        seen.update(status_json(cluster, run.dir))
        return seen["state"] == "running" and (seen["step"] or 0) >= 2

    wait_until(running_with_steps, TRAIN_TIMEOUT, f"job {run.job_id} to run some steps", interval=2)
    run.seen["running"] = dict(seen)
    finish(cluster, run)
    run.seen["completed"] = status_json(cluster, run.dir)
    run.seen["text"] = subprocess.run([PY, str(REPO / "launch" / "status.py"), str(run.dir)], capture_output=True,
                                      text=True, timeout=120, env=cluster.env).stdout
    return run


def report_rows(cluster: Cluster, run: Run, out: Path) -> List[Dict[str, str]]:
    """analysis/report.py on the run (with its sacct -D dump beside it): the rows of interruptions.csv."""
    import csv

    (run.dir / "sacct.txt").write_text(cluster.sacct_dump(run.job_id))
    res = subprocess.run([PY, str(REPO / "analysis" / "report.py"), str(run.dir), "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    with open(out / "interruptions.csv") as f:
        return list(csv.DictReader(f))


def report_causes(cluster: Cluster, run: Run, out: Path) -> Dict[int, str]:
    """analysis/report.py on the run: cause per interrupted attempt."""
    return {int(r["attempt"]): f"{r['cause']} ({r['evidence']})" for r in report_rows(cluster, run, out)}


SCENARIOS: Dict[str, Callable[[Cluster, Path], object]] = {  # two at a time, in this order
    # the time-limit scenario first, beside light ones: its rerun must fit a 3-minute slice
    "time_limit": time_limit,  # a 3-minute slice, then the rerun: about 3.5 minutes
    "completes": completes,  # the reference losses of the tests that compare
    "crash_loop": crash_loop,
    "no_megatron": no_megatron,
    # then the longest first, so that the pool's slots end together (seen at load ~10: 2.5 to 1 minutes)
    "in_job": in_job,
    "node_down": node_down,
    "node_crash": node_crash,
    "preempted_at_start": preempted_at_start,
    "hang": hang,
    "user_requeue": user_requeue,
    "preemption": preemption,
    "admin_requeue": admin_requeue,
    "drain": drain,
    "sweep": sweep,
    "user_cancel": user_cancel,
    "slow_cancel": slow_cancel,
    "watched": watched,
    "slices": slices,  # the light lane's longest (a 1-minute slice's start-up under load can take all of it)
    "slow_start": slow_start,
    "async_requeue": async_requeue,
    "budget": budget,
}
LIGHT = ("slices", "slow_start", "async_requeue", "budget")  # mostly waiting: their own lane, beside the trainings above


NEEDS = {  # test -> the scenarios it reads; only those of the selected tests run (-k works)
    "test_completes": ["completes"],
    "test_time_limit_warning_requeues_and_resumes_with_equal_losses": ["time_limit", "completes"],
    "test_node_set_down_is_node_fail_then_resume_from_last_checkpoint": ["node_down"],
    "test_node_crash_is_node_fail_then_resume_from_last_checkpoint": ["node_crash"],
    "test_preemption_sigterm_checkpoint_within_grace_then_resume": ["preemption", "completes"],
    "test_preemption_before_the_first_step_requeues_and_completes": ["preempted_at_start", "completes"],
    "test_deterministic_crash_loop_is_stopped_by_the_zero_progress_guard": ["crash_loop"],
    "test_unimportable_megatron_is_requeued_only_until_the_start_up_rule_stops_it": ["no_megatron"],
    "test_sigstopped_rank_is_a_hang_detected_named_and_requeued": ["hang", "completes"],
    "test_sweep_skips_invalid_layout_submits_the_rest_and_detaches": ["sweep"],
    "test_scancel_cancels_without_requeue_after_a_stop_checkpoint": ["user_cancel"],
    "test_drain_command_ends_without_requeue_and_the_run_continues": ["drain", "completes"],
    "test_scancel_signal_usr2_requeues_now_recorded_as_user_requeue": ["user_requeue", "completes"],
    "test_report_names_who_stopped_each_run": ["user_cancel", "drain", "user_requeue", "preemption"],
    "test_admin_scontrol_requeue_is_a_user_requeue": ["admin_requeue"],
    "test_a_cancel_slower_than_killwait_is_reported_as_the_cancel": ["slow_cancel"],
    "test_status_after_a_drain_says_stopped_and_how_to_continue": ["drain"],
    "test_in_job_crash_lost_node_and_hang_continue_in_the_same_job_with_equal_losses": ["in_job", "completes"],
    "test_budget_stop_is_final_with_a_checkpoint_and_a_resubmission_is_refused": ["budget"],
    "test_a_slice_whose_start_up_outlasts_the_slice_requeues_and_the_chain_continues": ["slow_start"],
    "test_run_longer_than_its_time_limit_finishes_over_slices_without_lost_progress": ["slices"],
    "test_user_requeue_during_an_async_write_waits_saves_and_resumes": ["async_requeue"],
    "test_status_follows_a_run_from_pending_to_completed": ["watched"],
}


@pytest.fixture(scope="module")
def scenarios(request: pytest.FixtureRequest, slurm_cluster: Cluster,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, Future]]:
    selected = {item.name for item in request.session.items if item.module is request.module}
    wanted = {name for test in selected for name in NEEDS.get(test, [])}
    pools = {lane: ThreadPoolExecutor(max_workers=slots, thread_name_prefix=f"{lane}-scenario")
             for lane, slots in (("training", 2), ("light", 2))}
    order = [n for n in SCENARIOS if n in wanted and n not in LIGHT] + [n for n in LIGHT if n in wanted]
    futures: Dict[str, Future] = {}
    for name in order:
        fn, lane = SCENARIOS[name], "light" if name in LIGHT else "training"
        if lane == "light" and "time_limit" in futures:  # its rerun must fit a 3-minute slice: no start-ups beside it
            fn = after(futures["time_limit"], fn)
        futures[name] = pools[lane].submit(fn, slurm_cluster, tmp_path_factory.mktemp(name))
    try:
        yield futures
    finally:
        for pool in pools.values():
            pool.shutdown(wait=True, cancel_futures=True)
        for node in slurm_cluster.spec.node_names:  # a node a scenario killed is back for the next module
            wait_until(lambda: slurm_cluster.in_service(node), 180, f"{node} back in service")


def after(gate: Future, fn: Callable[[Cluster, Path], object]) -> Callable[[Cluster, Path], object]:
    """``fn``, started once ``gate`` has ended (however it ended: its own test reports a failure)."""
    def gated(cluster: Cluster, d: Path) -> object:
        wait([gate])
        return fn(cluster, d)
    return gated


def result(scenarios: Dict[str, Future], name: str) -> Run:
    return scenarios[name].result(timeout=4 * TRAIN_TIMEOUT)


# ----------------------------------------------------------------------------- tests


def test_rendered_script_is_checked_by_the_scheduler(slurm_cluster: Cluster, tmp_path: Path) -> None:
    from launch.compose import compose_job
    from launch.render import render

    def rendered(name: str, *overrides: str) -> Path:
        job = compose_job(["cluster=slurm_local", "parallelism=tp2", f"run.dir={tmp_path / name}", *overrides])
        path = tmp_path / f"{name}.sh"
        path.write_text(render(job, tmp_path / name))
        return path

    script = rendered("ok", "run.time_limit_min=10")
    ok = slurm_cluster.run("sbatch", "--test-only", str(script), check=False)
    assert ok.returncode == 0 and "to start at" in ok.stderr, ok.stderr
    # more GPUs per node than a node has: the scheduler refuses the script
    gpus = slurm_cluster.run("sbatch", "--test-only", "--gpus-per-node=9", str(script), check=False)
    assert gpus.returncode != 0 and "Requested node configuration is not available" in gpus.stderr, gpus.stderr
    # a time limit above the partition's: the job check refuses it before anything is submitted ...
    big = pretrain(slurm_cluster, tmp_path, f"run.dir={tmp_path / 'big'}", "run.name=big", "run.time_limit_min=60")
    assert big.returncode == 2, f"{big.stdout}\n{big.stderr}"
    assert "run.time_limit_min" in big.stderr
    assert not (tmp_path / "big").exists()
    # ... and the scheduler refuses the same script rendered anyway (EnforcePartLimits=ALL)
    late = slurm_cluster.run("sbatch", "--test-only", str(rendered("late", "run.time_limit_min=60")), check=False)
    assert late.returncode != 0, late.stderr
    assert "time limit" in late.stderr.lower(), late.stderr



def test_completes(scenarios: Dict[str, Future]) -> None:
    run = result(scenarios, "completes")
    assert states(run) == ["COMPLETED"], run.logs()
    assert run.restarts == 0
    assert run.step_reached() == ITERS, run.logs()
    assert [e["reason"] for e in run.of("exit")] == ["completed"]
    assert sorted(run.losses()) == list(range(1, ITERS + 1))


def test_time_limit_warning_requeues_and_resumes_with_equal_losses(scenarios: Dict[str, Future]) -> None:
    run, ref = result(scenarios, "time_limit"), result(scenarios, "completes")
    # Slurm: the same job id ran twice; the first attempt was requeued (by the worker, on the
    # USR2 warning), not killed by the limit (TIMEOUT is never requeued)
    assert states(run) == ["REQUEUED", "COMPLETED"], run.logs()
    assert run.restarts == 1
    assert {r["JobID"] for r in run.sacct} == {run.job_id}
    sig = run.of("signal")
    assert [e["signal"] for e in sig] == ["SIGUSR2"], run.logs()
    stop_step = sig[0]["step"]
    assert 0 < stop_step < ITERS
    # the stop step is durable: saved on the signal, or already saved by the interval just before
    saved = {e["step"]: e["reason"] for e in run.of("checkpoint_saved") if e["restart_count"] == 0}
    assert saved.get(stop_step) in ("signal", "interval"), run.logs()
    assert [(e["method"], e["job_id_requeued"]) for e in run.of("requeue")] == [("scontrol", run.job_id)]
    # USR2 within the lead time (+ Slurm's check period) of the job's EndTime: the time-limit warning
    assert [(e["reason"], e["requeue"]) for e in run.of("stop")] == [("time_limit", True)], run.logs()
    resumed = run.of("resume")
    assert [(e["restart_count"], e["step"]) for e in resumed] == [(1, stop_step)], run.logs()
    # training: the interrupted run reached the end with exactly the uninterrupted run's losses
    assert run.step_reached() == ITERS
    assert run.losses() == ref.losses()


def _assert_node_failure_recovered(run: Run, cluster: Cluster) -> None:
    # Slurm: NODE_FAIL recorded for the first attempt, requeued under the same id, completed.
    # An attempt that lands on the failed node again may requeue itself away from it before
    # training (an 'exclude' event, a REQUEUED row); nothing else may come between.
    st = states(run)
    assert st[0] == "NODE_FAIL" and st[-1] == "COMPLETED", run.logs()
    assert st[1:-1] == ["REQUEUED"] * len(run.of("exclude")), run.logs()
    assert run.restarts == len(st) - 1
    assert run.seen["node"] in cluster.hostnames(run.sacct[0]["NodeList"])
    # training: resumed (once) from the newest checkpoint the failed attempt committed, then finished.
    # The interval save at step 10 came before the failure; when the ranks outlive the node's
    # failure (a node set DOWN keeps its processes here), Slurm SIGTERMs the step and they also
    # commit a stop checkpoint, which is then the newest.
    assert max(run.seen["ckpt_steps_before"]) == 10  # type: ignore[arg-type]
    first = [e["step"] for e in run.of("checkpoint_saved") if e["restart_count"] == 0]
    last_ckpt = max(first)
    assert last_ckpt >= 10 and set(first) - {10} <= {e["step"] for e in run.of("signal")}, run.logs()
    assert [(e["restart_count"], e["step"]) for e in run.of("resume")] == [(run.restarts, last_ckpt)], run.logs()
    assert run.step_reached() == ITERS
    assert [e["reason"] for e in run.of("exit")][-1] == "completed"
    # steps recomputed after the resume gave the same losses as the first time
    first_time: Dict[int, str] = {}
    for e in run.of("iteration"):
        first_time.setdefault(e["step"], e["loss"])
    assert first_time == run.losses()


def test_node_set_down_is_node_fail_then_resume_from_last_checkpoint(scenarios: Dict[str, Future],
                                                                    slurm_cluster: Cluster) -> None:
    run = result(scenarios, "node_down")
    _assert_node_failure_recovered(run, slurm_cluster)


def test_node_crash_is_node_fail_then_resume_from_last_checkpoint(scenarios: Dict[str, Future],
                                                                  slurm_cluster: Cluster) -> None:
    run = result(scenarios, "node_crash")
    assert len(run.seen["killed"]) >= 3, "slurmd, its slurmstepd and its rank should have been killed"
    _assert_node_failure_recovered(run, slurm_cluster)


def test_preemption_sigterm_checkpoint_within_grace_then_resume(scenarios: Dict[str, Future], slurm_cluster: Cluster) -> None:
    run = result(scenarios, "preemption")
    grace = slurm_cluster.spec.grace_time_s
    # Slurm: the preempted attempt was REQUEUED (not FAILED by a rank dying on SIGTERM, and
    # not PREEMPTED by the kill at the end of the grace time), and the urgent job ran
    assert states(run) == ["REQUEUED", "COMPLETED"], run.logs()
    assert run.restarts == 1
    assert run.seen["preemptor_state"] == "COMPLETED"
    # every rank caught SIGTERM: a rank without the handler dies with 143 and fails the job
    assert "exit code 143" not in run.logs()
    sig = run.of("signal")
    assert [e["signal"] for e in sig] == ["SIGTERM"], run.logs()
    stop_step = sig[0]["step"]
    assert stop_step >= 12
    # the stop step is durable (saved on the signal, or by the interval just before) within the grace time
    saved = [e for e in run.of("checkpoint_saved") if e["restart_count"] == 0 and e["step"] == stop_step]
    assert len(saved) == 1, run.logs()
    assert saved[0]["time"] - float(run.seen["preempted_at"]) < grace, "the checkpoint missed the grace time"
    assert [e["method"] for e in run.of("requeue")] == ["scontrol"]
    # Slurm said preemption (RUNNING with a PreemptTime in the grace time): requeued, as before
    assert [(e["reason"], e["requeue"]) for e in run.of("stop")] == [("preemption", True)], run.logs()
    assert "PreemptTime=" in run.of("stop")[0]["evidence"]
    assert [(e["restart_count"], e["step"]) for e in run.of("resume")] == [(1, stop_step)]
    assert run.step_reached() == ITERS
    assert run.losses() == result(scenarios, "completes").losses()


def test_preemption_before_the_first_step_requeues_and_completes(scenarios: Dict[str, Future]) -> None:
    run, ref = result(scenarios, "preempted_at_start"), result(scenarios, "completes")
    assert states(run) == ["REQUEUED", "COMPLETED"], run.logs()
    assert run.restarts == 1
    assert [e["signal"] for e in run.of("signal")] == ["SIGTERM"], run.logs()
    assert run.step_reached() == ITERS, run.logs()
    assert [e["reason"] for e in run.of("exit")] == ["requeue", "completed"], run.logs()
    assert run.losses() == ref.losses()  # nothing trained before the stop: the same run as uninterrupted


def test_deterministic_crash_loop_is_stopped_by_the_zero_progress_guard(scenarios: Dict[str, Future]) -> None:
    run = result(scenarios, "crash_loop")
    # step r0 crashed -> relaunched in the job (budget 1); r1 crashed -> budget spent -> requeued by the batch
    # script (the requeue path, recovery/crash.py); the requeued attempt's step r2 refused to start: exit 3
    assert states(run) == ["REQUEUED", "FAILED"], run.logs()
    assert run.restarts == 1
    assert [(e["restart_count"], e["cause"]) for e in run.of("in_job_restart")] == [(0, "crash")], run.logs()
    requeues = run.of("requeue")
    assert [(e["restart_count"], e.get("method")) for e in requeues] == [(1, "scontrol_after_crash")], run.logs()
    assert "in-job budget is spent" in requeues[0]["detail"]
    stops = run.of("stop")
    assert [(e["restart_count"], e["reason"]) for e in stops] == [(0, "crash"), (1, "crash"), (2, "zero_progress")]
    assert "SLURMTRON_TEST_FAIL_AT_ITER=3" in stops[0]["detail"]
    assert stops[-1]["code"] == 3
    assert run.step_reached() == 2  # step 3 never completed; no checkpoint was ever written
    assert not run.of("checkpoint_saved")


def test_unimportable_megatron_is_requeued_only_until_the_start_up_rule_stops_it(scenarios: Dict[str, Future]) -> None:
    run = result(scenarios, "no_megatron")
    # attempts 0 and 1 failed to start and were requeued; attempt 2 was refused by the start-up rule (exit 3, final)
    assert states(run) == ["REQUEUED", "REQUEUED", "FAILED"], run.logs()
    assert run.restarts == 2  # training.zero_progress_restarts requeues, not one more
    stops = [(e["restart_count"], e["reason"]) for e in run.of("stop") if e.get("rank") == 0]
    assert stops == [(0, "crash"), (1, "crash"), (2, "zero_progress")], run.logs()
    assert "megatron is not importable on node" in run.of("stop")[-1]["detail"]
    failed = sorted(p.name for p in (run.dir / "startup").iterdir())
    assert failed == [f"{run.job_id}_{a}_rank{r}.json" for a in (0, 1) for r in (0, 1)]
    assert {e["error"] for e in run.of("startup_failed")} == {"ModuleNotFoundError: No module named 'megatron.core'"}
    said = "".join(f.read_text(errors="replace") for f in (run.dir / "logs").glob("*.out"))
    assert "Traceback" not in said and said.count("megatron is not importable on node") == 2, run.logs()  # 2 ranks


def test_sigstopped_rank_is_a_hang_detected_named_and_requeued(scenarios: Dict[str, Future]) -> None:
    run, ref = result(scenarios, "hang"), result(scenarios, "completes")
    # Slurm: the hung attempt ended (the watchers killed their ranks), the batch script requeued it
    assert states(run) == ["REQUEUED", "COMPLETED"], run.logs()
    hangs = run.of("hang")
    assert len(hangs) == 1, run.logs()
    # exactly the stopped rank is the suspect (named by its process state); the other stage, waiting for it, is a victim
    stopped = hangs[0]["suspects"]
    assert [s["rank"] for s in stopped] == [1] and "process stopped" in stopped[0]["why"], hangs[0]
    assert stopped[0]["host"].startswith("stn"), hangs[0]
    assert {s["rank"] for s in hangs[0]["suspects"]} | {v["rank"] for v in hangs[0]["victims"]} == {0, 1}
    d = run.dir / "hangs" / f"{run.job_id}_0"
    for r in range(2):
        assert "File " in (d / f"rank{r}.stacks.txt").read_text()
    summary = json.loads((d / "summary.json").read_text())
    latency = summary["ended"] - run.seen["stopped_at"]
    print(f"\nSlurm: SIGSTOP -> attempt ended in {latency:.1f} s (step deadline {summary['missed']['seconds']:.1f} s)")
    assert latency <= summary["missed"]["seconds"] + 15
    assert [e.get("method") for e in run.of("requeue")] == ["scontrol_after_crash"], run.logs()
    newest = max(e["step"] for e in run.of("checkpoint_saved") if e["restart_count"] == 0)
    assert [(e["restart_count"], e["step"]) for e in run.of("resume")] == [(1, newest)]
    assert run.step_reached() == ITERS and run.losses() == ref.losses()


def test_sweep_skips_invalid_layout_submits_the_rest_and_detaches(scenarios: Dict[str, Future]) -> None:
    out = scenarios["sweep"].result(timeout=4 * TRAIN_TIMEOUT)
    res = out["res"]
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    assert len(out["registry"]) == 1, out["registry"]
    by_tp = {json.dumps(e["overrides"]): e for e in out["entries"]}
    assert len(by_tp) == 3, out["entries"]
    refused = [e for e in out["entries"] if e["status"] == "refused"]
    submitted = [e for e in out["entries"] if e["status"] == "submitted"]
    assert [e["overrides"] for e in refused] == [["parallelism.tp=4"]] or \
        any("parallelism.tp=4" in e["overrides"] for e in refused), out["entries"]
    assert len(refused) == 1 and refused[0]["job_id"] is None
    assert any("parallelism.tp" in r or "tp 4" in r for r in refused[0]["reasons"]), refused[0]["reasons"]
    assert len(submitted) == 2 and all(e["job_id"] for e in submitted)
    # submit-and-detach: when the command returned, both jobs were still queued or running
    assert set(out["live"].values()) <= {"PENDING", "RUNNING", "CONFIGURING"}, out["live"]
    assert set(out["ended"].values()) == {"CANCELLED"}, out["ended"]
    for e in submitted:
        assert (Path(e["run_dir"]) / "sbatch.sh").exists()


def _stop_checkpoint_verified(run: Run, stop_step: int) -> None:
    """The stop step is the newest checkpoint, and its manifest and checksums verify."""
    from recovery.resume import find_latest_verified

    found = find_latest_verified(run.dir / "checkpoints")
    assert found.step == stop_step and not found.skipped, (found, run.logs())


def test_scancel_cancels_without_requeue_after_a_stop_checkpoint(scenarios: Dict[str, Future]) -> None:
    run = result(scenarios, "user_cancel")
    # Slurm: one attempt, CANCELLED, never requeued (the ranks did not ask for it)
    assert states(run) == ["CANCELLED"], run.logs()
    assert run.restarts == 0
    assert not run.of("requeue"), run.logs()
    sig = run.of("signal")
    assert [e["signal"] for e in sig] == ["SIGTERM"], run.logs()
    stop_step = sig[0]["step"]
    assert stop_step >= 12
    # the ranks asked Slurm: the accounting said CANCELLED during the kill window
    (stop,) = run.of("stop")
    assert (stop["reason"], stop["requeue"], stop["step"]) == ("user_cancel", False, stop_step), run.logs()
    assert "sacct CANCELLED" in stop["evidence"], stop["evidence"]
    assert [e["reason"] for e in run.of("exit")] == ["stopped"]
    # a stop checkpoint within KillWait, committed and verified (or the interval save of that very step)
    saved = [e for e in run.of("checkpoint_saved") if e["step"] == stop_step]
    assert len(saved) == 1 and saved[0]["reason"] in ("signal", "interval"), run.logs()
    _stop_checkpoint_verified(run, stop_step)
    # a later continuation (dependency chain) or a raced requeue would refuse to start
    doc = json.loads((run.dir / "stop.json").read_text())
    assert (doc["state"], doc["reason"], doc["step"]) == ("stopped", "user_cancel", stop_step)


def test_drain_command_ends_without_requeue_and_the_run_continues(scenarios: Dict[str, Future]) -> None:
    run, ref = result(scenarios, "drain"), result(scenarios, "completes")
    stop_cmd = run.seen["stop_cmd"]
    assert stop_cmd.returncode == 0 and "stop requested" in stop_cmd.stdout, stop_cmd.stdout + stop_cmd.stderr
    # Slurm: the drained job ended COMPLETED (every rank exited 0), with no requeue
    assert states(run) == ["COMPLETED"] and run.restarts == 0, run.logs()
    first = [e for e in run.events() if e["job_id"] == run.job_id]
    stops = [e for e in first if e["event"] == "stop"]
    assert [(e["reason"], e["requeue"]) for e in stops] == [("user_stop", False)], run.logs()
    stop_step = stops[0]["step"]
    assert 12 <= stop_step < ITERS
    assert not [e for e in first if e["event"] in ("requeue", "signal")]
    assert [e["reason"] for e in first if e["event"] == "exit"] == ["stopped"]
    assert run.seen["stop_file"]["state"] == "stopped" and run.seen["stop_file"]["step"] == stop_step
    # submitting the same run again continues it from the stop checkpoint, to the uninterrupted run's losses
    again = run.seen["again"]
    assert states(again) == ["COMPLETED"], again.logs()
    resumed = [e for e in again.of("resume") if e["job_id"] == again.job_id]
    assert [e["step"] for e in resumed] == [stop_step], again.logs()
    assert again.step_reached() == ITERS
    assert again.losses() == ref.losses()
    assert not (run.dir / "stop.json").exists()


def test_scancel_signal_usr2_requeues_now_recorded_as_user_requeue(scenarios: Dict[str, Future]) -> None:
    run, ref = result(scenarios, "user_requeue"), result(scenarios, "completes")
    assert states(run) == ["REQUEUED", "COMPLETED"], run.logs()
    assert run.restarts == 1
    assert [e["signal"] for e in run.of("signal")] == ["SIGUSR2"]
    (stop,) = run.of("stop")
    assert (stop["reason"], stop["requeue"]) == ("user_requeue", True), run.logs()
    assert "before EndTime" in stop["evidence"]
    assert [e["method"] for e in run.of("requeue")] == ["scontrol"]
    assert [(e["restart_count"], e["step"]) for e in run.of("resume")] == [(1, stop["step"])]
    assert run.step_reached() == ITERS and run.losses() == ref.losses()


def test_report_names_who_stopped_each_run(scenarios: Dict[str, Future], slurm_cluster: Cluster,
                                           tmp_path: Path) -> None:
    want = {"user_cancel": "user_cancel", "drain": "user_stop", "user_requeue": "user_requeue",
            "preemption": "preemption"}
    for name, cause in want.items():
        causes = report_causes(slurm_cluster, result(scenarios, name), tmp_path / name)
        assert list(causes) == [0], causes  # one interrupted attempt per run
        assert causes[0].startswith(f"{cause} ("), (name, causes)
        assert "event stop" in causes[0], causes


def test_admin_scontrol_requeue_is_a_user_requeue(scenarios: Dict[str, Future], slurm_cluster: Cluster,
                                                  tmp_path: Path) -> None:
    run = result(scenarios, "admin_requeue")
    assert states(run) == ["REQUEUED", "COMPLETED"], run.logs()
    first = [e for e in run.events() if e.get("restart_count") == 0]
    # the ranks name it when their stop save fits in KillWait (5 s here; under load it may not, and then the
    # report names it from sacct: REQUEUED, not PREEMPTED, and no requeue of the ranks' own)
    for stop in [e for e in first if e["event"] == "stop"]:
        assert stop["reason"] == "user_requeue" and "Slurm already requeued the job" in stop["evidence"], stop
    for e in run.of("requeue"):
        assert "failed" not in str(e.get("detail")) and "pending execution" not in str(e.get("detail")), e
    causes = report_causes(slurm_cluster, run, tmp_path / "report")
    assert causes[0].startswith("user_requeue ("), causes
    assert run.step_reached() == ITERS


def test_a_cancel_slower_than_killwait_is_reported_as_the_cancel(scenarios: Dict[str, Future], slurm_cluster: Cluster,
                                                                 tmp_path: Path) -> None:
    run = result(scenarios, "slow_cancel")
    assert states(run) == ["CANCELLED"] and run.restarts == 0, run.logs()
    assert not [e for e in run.of("stop") if e.get("reason") == "crash"], run.logs()
    causes = report_causes(slurm_cluster, run, tmp_path / "report")
    assert list(causes) == [0] and causes[0].startswith("user_cancel ("), causes


def test_status_after_a_drain_says_stopped_and_how_to_continue(scenarios: Dict[str, Future]) -> None:
    run = result(scenarios, "drain")
    st = run.seen["status"]
    assert st.returncode == 0, st.stderr
    stop_step = [e for e in run.events() if e["event"] == "stop" and e["job_id"] == run.job_id][0]["step"]
    assert f"stopped (user_stop at step {stop_step}; continue with:" in st.stdout, st.stdout
    assert "worker logged no completion" not in st.stdout and "ETA" not in st.stdout, st.stdout
    assert "log analysis failed" not in st.stdout + st.stderr


def test_in_job_crash_lost_node_and_hang_continue_in_the_same_job_with_equal_losses(
        scenarios: Dict[str, Future], slurm_cluster: Cluster, tmp_path: Path) -> None:
    run, ref = result(scenarios, "in_job"), result(scenarios, "completes")
    # Slurm: one job id, never requeued (the lost node only resized the allocation), completed
    assert "REQUEUED" not in states(run) and states(run)[-1] == "COMPLETED", run.logs()
    assert run.restarts == 0 and {r["JobID"] for r in run.sacct} == {run.job_id}
    crash, lost, hang = run.of("in_job_restart")
    # the crash: relaunched in the job on the same nodes
    assert crash["cause"] == "crash" and crash["nodes"] == crash["failed_nodes"] and not crash["spare_used"], run.logs()
    # the lost node: the spare replaced it, and it was not used again
    node = run.seen["node"]
    assert lost["cause"] == "lost_node" and node in lost["avoided"] and node not in lost["nodes"], run.logs()
    assert lost["spare_used"] and lost["spare_used"][0] not in crash["nodes"]
    # the hang: the watchdog named the stopped rank's node, and the last spare replaced it (a suspect is avoided
    # when a spare allows; it is not recorded as failed)
    suspect = run.seen["stopped_on"]
    assert hang["cause"] == "hang" and hang["failed_nodes"] == lost["nodes"], run.logs()
    assert suspect in hang["avoided"] and "hang suspect" in hang["avoided"][suspect], hang
    assert suspect not in hang["nodes"] and hang["spare_used"] and not hang["suspects_kept"], hang
    assert hang["spare_used"][0] not in crash["nodes"] + lost["nodes"], hang
    assert [e["restart_count"] for e in run.of("job_start")] == [0, 1, 2, 3]
    assert node not in run.of("job_start")[-1]["nodes"] and suspect not in run.of("job_start")[-1]["nodes"]
    failed = [n["host"] for n in json.loads((run.dir / "failed_nodes.json").read_text())]
    assert node in failed and suspect not in failed, failed
    # each relaunch resumed from the newest local set (a step after the global checkpoint it would otherwise have
    # used), losing at most the step the failure interrupted; the lost node's and the suspect's shards came from
    # their replicas on the node that stayed
    came = [(e["restart_count"], e["tier"], e["global_step"]) for e in run.of("resumed_from")]
    assert came == [(1, "local", 5), (2, "local", 10), (3, "local", 15)], run.logs()
    assert all(e["step"] > e["global_step"] and e["lost_steps"] <= 1 for e in run.of("resumed_from")), run.logs()
    resumes = [e for e in run.of("resume") if e["restart_count"] > 0]
    assert all(e["checkpoint"].startswith("local:") for e in resumes), resumes
    for e, before, now in zip(resumes[1:], (crash, lost), (lost, hang)):  # a replaced node: its set came from the
        [stayed] = set(before["nodes"]) & set(now["nodes"])  # replica on the node that stayed (the spare has none)
        assert e["checkpoint"].endswith(f"on node(s) {stayed}"), (e, before["nodes"], now["nodes"])
    assert not run.of("requeue")
    # training: the uninterrupted run's losses
    assert run.step_reached() == ITERS and run.losses() == ref.losses(), run.logs()
    # the report: each interruption recovered in the job, its cause, and the time to resume split into phases
    rows = report_rows(slurm_cluster, run, tmp_path / "report")
    assert [(r["attempt"], r["cause"], r["recovery"]) for r in rows] == [
        ("0", "crash", "recovered in job"), ("1", "node_failure", "recovered in job"),
        ("2", "hang", "recovered in job")], rows
    for r in rows:
        phases = {k: float(r[k]) for k in ("detection_s", "teardown_s", "health_check_s", "startup_s",
                                           "checkpoint_load_s", "first_step_s", "time_to_resume_s")}
        assert float(r["queue_wait_s"]) == 0.0 and phases["startup_s"] > 0 and phases["checkpoint_load_s"] > 0, r
        parts = [v for k, v in phases.items() if k != "time_to_resume_s" and v == v]  # detection: nan if unsaid
        assert sum(parts) <= phases["time_to_resume_s"] + 1, r


def test_budget_stop_is_final_with_a_checkpoint_and_a_resubmission_is_refused(scenarios: Dict[str, Future],
                                                                              slurm_cluster: Cluster) -> None:
    from recovery.exit_codes import EXIT_BUDGET

    run = result(scenarios, "budget")
    # Slurm: one attempt, ended by the ranks' final exit code through the batch script (never requeued)
    assert states(run) == ["FAILED"] and run.restarts == 0, run.logs()
    assert run.seen["exit_code"] == [f"{EXIT_BUDGET}:0"], run.seen["exit_code"]
    assert not run.of("requeue") and not run.of("in_job_restart"), run.logs()
    assert [e["restart_count"] for e in run.of("job_start")] == [0]
    # the ranks: the spend came from Slurm's accounting, crossed 50/80/95%, then the budget stop at a step boundary
    warned = [e for e in run.of("budget_warning") if e["threshold"] != "projected"]
    assert [e["threshold"] for e in warned] == [0.5, 0.8, 0.95] and {e["source"] for e in warned} == {"sacct"}, \
        run.logs()
    (stop,) = run.of("stop")
    assert (stop["reason"], stop["code"]) == ("budget", EXIT_BUDGET), run.logs()
    step = stop["step"]
    assert 0 < step < 1000, f"the budget ({BUDGET_WALL_S} s) was spent before the first step: start-up too slow"
    assert f"at iteration {step}: stopped with a verified checkpoint" in stop["detail"], stop["detail"]
    assert [(e["reason"], e["code"]) for e in run.of("exit")] == [("budget", EXIT_BUDGET)], run.logs()
    assert run.step_reached() == step
    _stop_checkpoint_verified(run, step)
    # the same command with the budget still spent: refused at submit with the arithmetic, nothing submitted
    again = run.seen["again"]
    assert again.returncode == 2, again.stdout + again.stderr
    assert "run.budget_gpu_hours" in again.stderr and "(Slurm accounting) >= budget" in again.stderr, again.stderr
    assert "raise it to continue the run: run.budget_gpu_hours=" in again.stderr, again.stderr
    assert len((run.dir / "submissions.jsonl").read_text().splitlines()) == 1
    assert run.seen["jobs_after"] == [], run.seen["jobs_after"]


def test_a_slice_whose_start_up_outlasts_the_slice_requeues_and_the_chain_continues(
        scenarios: Dict[str, Future]) -> None:
    run = result(scenarios, "slow_start")
    assert states(run) == ["REQUEUED", "COMPLETED"], run.logs()
    first = [e for e in run.events() if e.get("restart_count") == 0]
    assert not [e for e in first if e["event"] == "iteration"], "the slow slice must not have trained"
    [stop] = [e for e in first if e["event"] == "stop"]
    assert stop["reason"] == "time_limit" and stop["saved"] is False, stop
    assert "during start-up, before the first step" in stop["evidence"]
    assert [e["method"] for e in first if e["event"] == "requeue"][:1] == ["scontrol"]
    assert run.step_reached() == ITERS and [e["reason"] for e in run.of("exit")][-1] == "completed", run.logs()


def test_run_longer_than_its_time_limit_finishes_over_slices_without_lost_progress(
        scenarios: Dict[str, Future]) -> None:
    run = result(scenarios, "slices")
    diag = "\n".join(json.dumps(r) for r in run.sacct) + "\n" + run.logs()
    assert run.final == "COMPLETED", diag
    events = run.events()
    steps = [e["step"] for e in events if e["event"] == "iteration"]
    # every step trained exactly once over all slices: nothing lost, nothing repeated
    assert sorted(steps) == list(range(1, SLICE_ITERS + 1)) and len(steps) == SLICE_ITERS, diag
    attempts = sorted({e["restart_count"] for e in events if e["event"] == "job_start"})
    assert len(attempts) >= 2, diag  # it did not fit one slice
    # each slice starts where the newest save before it left off (a slice that spent its minute starting up
    # saves nothing new, and the next one starts at the same step: seen at load average 22)
    newest, resumes = None, []
    for e in events:
        if e["event"] == "checkpoint_saved":
            assert e.get("reason") in ("signal", "final"), diag  # checkpoint_interval=1000: only stops and the end
            newest = e["step"]
        elif e["event"] == "resume":
            resumes.append((e["step"], newest))
    assert resumes and all(step == want for step, want in resumes), (resumes, diag)
    assert [e["step"] for e in events if e["event"] == "train_end"] == [SLICE_ITERS]
    assert sum(r["State"].startswith("REQUEUED") for r in run.sacct) == len(attempts) - 1, diag


def test_user_requeue_during_an_async_write_waits_saves_and_resumes(scenarios: Dict[str, Future]) -> None:
    run = result(scenarios, "async_requeue")
    diag = "\n".join(json.dumps(r) for r in run.sacct) + "\n" + run.logs()
    assert run.final == "COMPLETED", diag
    events = run.events()
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
    steps = [e["step"] for e in events if e["event"] == "iteration"]
    assert sorted(steps) == list(range(1, ASYNC_ITERS + 1)) and len(steps) == ASYNC_ITERS, diag  # none lost/repeated


def test_status_follows_a_run_from_pending_to_completed(scenarios: Dict[str, Future], slurm_cluster: Cluster) -> None:
    run = result(scenarios, "watched")
    st = run.seen["pending"]
    assert (st["state"], st["reason"], st["job_id"], st["attempts"]) == ("pending", "BeginTime", run.job_id, 0)
    assert st["target"] == 20 and st["step"] is None and st["checkpoint_step"] is None
    seen = run.seen["running"]
    assert seen["attempts"] == 1 and seen["step_time_s"] > 0 and seen["eta_s"] > 0 and seen["log_tail"]
    st = run.seen["completed"]
    assert (st["state"], st["step"], st["target"], st["checkpoint_step"]) == ("completed", 20, 20, 20)
    assert st["interruptions"] == {} and st["goodput"] is not None and 0 < st["goodput"] <= 1
    # the GPU-hours spent are Slurm's accounting of the allocation: its Elapsed x the ranks (no GPU gres here)
    elapsed = sum(int(h) * 3600 + int(m) * 60 + int(sec) for h, m, sec in
                  (r["Elapsed"].split(":") for r in run.sacct))
    assert st["world_size"] == 2 and st["gpu_hours_source"] == "sacct"
    assert st["gpu_hours"] == pytest.approx(2 * elapsed / 3600)
    assert st["cost"] == pytest.approx(3 * st["gpu_hours"])
    text = run.seen["text"]
    assert f"state      completed; job {run.job_id}; attempts 1" in text and "step 20 / 20 (100.0%)" in text
    assert f"cost       {st['cost']:,.2f} (" in text and "x 3 per process-hour, so far, from the Slurm accounting" in text
