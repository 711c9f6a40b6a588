"""In-job restart: after a failed ``srun`` step, start the next one on healthy nodes of the same allocation.

A requeue costs a trip through the queue (Slurm's requeue delay, the queue wait, the prologue) on every failure.
With ``cluster.spare_nodes > 0`` the job holds ``nodes + spare_nodes`` nodes with ``sbatch --no-kill`` (a failed
node does not end the allocation) and the rendered batch script loops::

    export SLURMTRON_IN_JOB_OFFSET=$(python -m recovery.injob offset RUN_DIR)   # relaunches made before
    read -r STEP_NODES MASTER_ADDR < <(python -m recovery.injob first RUN_DIR --nodes N)
    srun --nodelist="$STEP_NODES" --nodes=N ... python -m train.worker RUN_DIR
    python -m recovery.injob next RUN_DIR --rc $rc --nodes "$STEP_NODES" [--no-requeue]
        # exit 0 and one line "NODES MASTER_ADDR": relaunch there; 42: requeued (the fallback); 1: stop

``next`` decides in this order:

1. **The judgement** of :func:`recovery.crash.judge` (the one the requeue path makes): only a crash, a hang or a
   lost node (an attempt killed before its exit event) is tried again; a final reason stays final, a held run
   lock writes nothing, ``training.max_restarts`` counts every step (each step's restart count is Slurm's plus
   the relaunches before it, :func:`recovery.policy.restart_count_from_env`), and the next step's own start
   decision applies the zero-progress guard, so a deterministic crash still stops.
2. **The budget**: ``cluster.in_job_restarts`` relaunches per allocation (``in_job_restart`` events of this
   job and Slurm restart count).
3. **The nodes to avoid**: recorded failed nodes (``failed_nodes.json``), nodes Slurm reports down, drained,
   failing or not responding (``sinfo``), nodes that fail the health check (one bounded ``srun`` task per
   candidate: the run directory writable, free space, the GPUs visible) — these are recorded as failed, so
   neither this allocation nor a requeue uses them again — and, when enough nodes are left without them, the
   hang watchdog's suspects (``hangs/<job>_<restart>/summary.json``).
4. **The pick**: the failed step's healthy nodes keep their places (ranks stay where they were), spares fill
   the gaps; the world size never changes; the rendezvous (MASTER_ADDR) is the first chosen node.

Not enough healthy nodes, or the budget spent: the requeue path (:func:`recovery.crash.requeue_after_crash`),
excluding the failed nodes. If the node running the batch script fails, Slurm ends the job (NODE_FAIL) and
its ``--requeue`` brings it back: this module never runs then.

Every relaunch writes one ``in_job_restart`` event: the cause, the nodes avoided and why, the spares used,
and the seconds of each phase it saw (detection: last progress to the failure's record; teardown: to the end
of the step; health check). The next step's own events give start-up, checkpoint load and the first step.

Side effects are injected (``runner`` for Slurm and srun, ``clock``, ``resolve``); no torch, no launch imports
beyond the run paths.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from launch.kinds import EventKind
from launch.paths import RunPaths
from recovery import crash, policy
from recovery.events import EventLog, read_events
from recovery.exclusion import BAD_NODE_STATES, recorded_hosts
from recovery.slurm import Runner, Slurm, default_runner
from recovery.watchdog import hang_dir

EXIT_RELAUNCH, EXIT_STOP = 0, 1
EVENT = EventKind.IN_JOB_RESTART
HEALTH_TIMEOUT_S = 60.0  # the whole health-check step; a node that does not answer within it is not healthy
MIN_FREE_BYTES = 1 << 30  # the run directory's filesystem must have this much free (a checkpoint needs room)
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")


# ---- what the run's records say ---------------------------------------------------------------

def relaunches(events: list[dict], job_id: str, slurm_restart: Optional[int] = None) -> list[dict]:
    """This job's ``in_job_restart`` events (of one Slurm attempt when ``slurm_restart`` is given)."""
    return [e for e in events if e.get("event") == EVENT and str(e.get("job_id")) == str(job_id)
            and (slurm_restart is None or int(e.get("slurm_restart") or 0) == slurm_restart)]


def offset(run_dir: Path, job_id: str) -> int:
    """How many in-job relaunches this job made before (all its Slurm attempts): the next step's offset."""
    if not job_id:
        return 0
    return len(relaunches(read_events(RunPaths.of(run_dir).events), job_id))


def standing(events: list[dict], spares: int, budget: int) -> Optional[dict]:
    """What ``status`` shows with spares (``None`` without): the in-job restarts used in the newest allocation
    (those of the newest job since its last requeue: a requeue brings a new allocation, whole budget and spares),
    the spares left, and the relaunches of the whole run."""
    if spares <= 0:
        return None
    out = {"spares": spares, "budget": budget, "used": 0, "spares_left": spares,
           "total": sum(1 for e in events if e.get("event") == EVENT)}
    jobs = [e.get("job_id") for e in events if e.get("job_id")]
    if not jobs:
        return out
    job = str(jobs[-1])
    now: list[dict] = []
    for e in events:
        if str(e.get("job_id")) != job:
            continue
        kind = e.get("event")
        if kind == EventKind.REQUEUE or (kind == EventKind.EXIT and e.get("reason") == "requeue"):
            now = []
        elif kind == EVENT:
            now.append(e)
    if now:
        out["used"], out["spares_left"] = len(now), int(now[-1].get("spares_left", spares))
    return out


def hang_suspects(run_dir: Path, job_id: str, restart: int) -> list[str]:
    """Hosts the hang watchdog named as suspects of this step's hang (none when it did not hang)."""
    path = hang_dir(RunPaths.of(run_dir).hangs, job_id, restart) / "summary.json"
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    hosts = [s.get("host") for s in summary.get("suspects", []) if isinstance(s, dict)] \
        if isinstance(summary, dict) else []
    return sorted({h for h in hosts if isinstance(h, str) and _HOST.match(h)})


# ---- what Slurm and the nodes say ---------------------------------------------------------------

def bad_states(hosts: Sequence[str], runner: Runner) -> dict[str, str]:
    """Hosts Slurm reports down, drained, failing or not responding (``sinfo``), with the state."""
    if not hosts:
        return {}
    r = Slurm(runner).node_states(hosts)
    out: dict[str, str] = {}
    if not r.ok:
        return out
    for line in r.out.splitlines():
        node, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        low = state.lower()
        if node in hosts and (low.endswith("*") or any(b in low for b in BAD_NODE_STATES)):
            out[node] = f"Slurm reports {state}" + (f" ({reason})" if reason and reason != "none" else "")
    return out


def probe_line(run_dir: Path, env: Mapping[str, str], *, gpus: int = 0, min_free: int = MIN_FREE_BYTES,
               listdev: Callable[[], list[str]] = lambda: os.listdir("/dev")) -> str:
    """One node's health, as one line: ``HOST ok`` or ``HOST bad <why>`` (run on the node by the check step)."""
    host = env.get("SLURMD_NODENAME") or socket.gethostname()
    run_dir = Path(run_dir)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".health.", dir=run_dir)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        return f"{host} bad run directory {run_dir} not writable ({e.strerror or e})"
    free = shutil.disk_usage(run_dir).free
    if free < min_free:
        return f"{host} bad {free / 2**30:.2f} GiB free under {run_dir} < {min_free / 2**30:.2f} GiB"
    if gpus > 0:
        visible = [d for d in listdev() if re.fullmatch(r"nvidia\d+", d)]
        if len(visible) < gpus:
            return f"{host} bad {len(visible)} GPU devices visible < {gpus}"
    return f"{host} ok"


def health_check(hosts: Sequence[str], run_dir: Path, runner: Runner, *, python: str = sys.executable,
                 gpus: int = 0, timeout: float = HEALTH_TIMEOUT_S) -> dict[str, str]:
    """The unhealthy ones of ``hosts`` with why: one ``srun`` task per host runs :func:`probe_line`.

    A host with no answer within ``timeout`` (dead, unreachable, a hung filesystem) is unhealthy. If the one
    step cannot start at all, each host is tried alone, so one dead node does not condemn the others."""
    if not hosts:
        return {}
    argv = [python, "-m", "recovery.injob", "probe", str(run_dir), "--gpus", str(gpus)]
    slurm = Slurm(runner)

    def ask(group: Sequence[str]) -> dict[str, str]:
        r = slurm.step(group, argv, timeout=timeout)
        said = {}
        for line in r.out.splitlines():
            host, _, rest = line.strip().partition(" ")
            if host in group:
                said[host] = rest
        return said if said or r.ok else {"": r.words or f"srun exited {r.rc}"}

    said = ask(hosts)
    if "" in said and len(hosts) > 1:
        said = {}
        for h in hosts:
            said.update({h if k == "" else k: v for k, v in ask([h]).items()})
    bad = {}
    for h in hosts:
        answer = said.get(h, said.get("", "no answer"))
        if answer != "ok":
            bad[h] = f"health check: {answer.removeprefix('bad ')}"[:200]
    return bad


def node_address(host: str, runner: Runner, resolve: Callable[[str], str] = socket.gethostbyname) -> str:
    """The rendezvous address of ``host``: the resolver's, else the NodeAddr Slurm uses, else the name."""
    try:
        return resolve(host)
    except OSError:
        pass
    r = Slurm(runner).call(["scontrol", "show", "node", host])
    m = re.search(r"\bNodeAddr=(\S+)", r.out) if r.ok else None
    return m.group(1) if m else host


# ---- the pick -------------------------------------------------------------------------------------

@dataclass
class Pick:
    """The next step's nodes, or why there are not enough (``nodes`` empty)."""

    nodes: list[str]
    avoided: dict[str, str] = field(default_factory=dict)  # host -> why (failed, down, unhealthy, suspect)
    spare_used: list[str] = field(default_factory=list)
    suspects_kept: list[str] = field(default_factory=list)  # suspects used because no spare was left
    short: str = ""


def choose(allocation: Sequence[str], previous: Sequence[str], need: int, hard: Mapping[str, str],
           soft: Mapping[str, str]) -> Pick:
    """``need`` nodes of ``allocation``: the previous step's healthy ones in their places, spares after; ``hard``
    are never used, ``soft`` (hang suspects) only when there are not enough others."""
    healthy = [h for h in allocation if h not in hard]
    order = [h for h in previous if h in healthy] + [h for h in healthy if h not in previous]
    clean = [h for h in order if h not in soft]
    if len(clean) >= need:
        chosen, kept = clean[:need], []
    elif len(order) >= need:
        chosen = [h for h in order if h not in soft] + [h for h in order if h in soft]
        chosen = chosen[:need]
        kept = [h for h in chosen if h in soft]
    else:
        return Pick([], dict(hard), short=(f"{len(order)} healthy node(s) of {len(allocation)} "
                                           f"({','.join(order) or 'none'}) < {need} needed"))
    avoided = {**dict(hard), **{h: soft[h] for h in soft if h not in chosen}}
    return Pick(chosen, avoided, [h for h in chosen if h not in previous], kept)


# ---- the decision -----------------------------------------------------------------------------------

@dataclass
class Decision:
    """``relaunch`` on ``nodes`` (rendezvous ``master_addr``), ``requeue`` (done: exit 42) or ``stop``."""

    action: str
    why: str
    code: int
    nodes: list[str] = field(default_factory=list)
    master_addr: str = ""
    event: Optional[dict] = None


def _times(events: list[dict]) -> tuple[Optional[float], Optional[float]]:
    """(last progress, the failure's record) of a step: its last iteration or checkpoint or start, and its
    stop/hang event (None when the step was killed before writing one)."""
    marks = (EventKind.ITERATION, EventKind.CHECKPOINT_SAVED, EventKind.JOB_START)
    progress = [e.get("time") for e in events if e.get("event") in marks]
    failed = [e.get("time") for e in events if e.get("event") in (EventKind.STOP, EventKind.HANG)]
    num = [t for t in progress if isinstance(t, (int, float))]
    fnum = [t for t in failed if isinstance(t, (int, float))]
    return (max(num) if num else None), (min(fnum) if fnum else None)


def cause_of(step_events: list[dict], lost: Sequence[str]) -> str:
    """``lost_node``, ``hang`` or ``crash``."""
    if lost:
        return "lost_node"
    if any(e.get("event") == EventKind.EXIT and e.get("reason") == "hang" for e in step_events):
        return "hang"
    return "crash"


def decide(run_dir: Path, env: Mapping[str, str], *, rc: Optional[int], step_nodes: Sequence[str],
           budget: int, runner: Runner = default_runner, requeue_allowed: bool = True,
           clock: Callable[[], float] = time.time, python: str = sys.executable, gpus: int = 0,
           resolve: Callable[[str], str] = socket.gethostbyname,
           health: Optional[Callable[[Sequence[str]], dict[str, str]]] = None) -> Decision:
    """After a failed step: relaunch in the allocation, fall back to the requeue path, or stop (see the module)."""
    run_dir = Path(run_dir)
    started = clock()
    verdict = crash.judge(run_dir, env, runner, rc=rc)
    if not verdict.again:
        return Decision("stop", verdict.why, verdict.code)
    job_id, restart = verdict.job_id, verdict.restart
    slurm_restart = policy.slurm_restart_count(env)
    paths = RunPaths.of(run_dir)
    events = read_events(paths.events)
    step = crash.attempt_events(events, job_id, restart)
    used = len(relaunches(events, job_id, slurm_restart))

    def fallback(why: str, lost: Sequence[str]) -> Decision:
        if not requeue_allowed:
            return Decision("stop", f"{verdict.why}; {why}; cluster.requeue_allowed is false: not requeued", 0)
        code, said = crash.requeue_after_crash(run_dir, env, runner, rc=rc, exclude=list(lost),
                                               detail=f"in-job restart not possible: {why}")
        return Decision("requeue" if code == policy.EXIT_REQUEUE else "stop", said, code)

    slurm = Slurm(runner)
    allocation = slurm.hostnames(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    previous = [h for h in step_nodes if h]
    need = len(previous) or int(env.get("SLURM_NNODES") or 0)
    recorded = set(recorded_hosts(run_dir))
    hard = {h: "recorded failed node (failed_nodes.json)" for h in allocation if h in recorded}
    hard.update({h: why for h, why in bad_states(allocation, runner).items() if h not in hard})
    if used >= budget:
        lost = [h for h in previous if h in hard]
        _record(run_dir, lost, hard, job_id, clock)
        return fallback(f"the in-job budget is spent ({used} of cluster.in_job_restarts {budget} used in this "
                        f"allocation)", sorted(set(lost) | recorded))
    t_health = clock()
    candidates = [h for h in allocation if h not in hard]
    check = health if health is not None else (
        lambda hosts: health_check(hosts, run_dir, runner, python=python, gpus=gpus))
    unhealthy = check(candidates)
    health_s = clock() - t_health
    hard.update(unhealthy)
    suspects = {h: "hang suspect (hangs/.../summary.json)" for h in hang_suspects(run_dir, job_id, restart)}
    pick = choose(allocation, previous, need, hard, suspects)
    lost = [h for h in previous if h in hard and h not in recorded]
    _record(run_dir, lost + [h for h in unhealthy if h not in previous and h not in recorded], hard, job_id, clock)
    if not pick.nodes:
        return fallback(f"not enough healthy nodes in the allocation: {pick.short}",
                        sorted(set(hard) | recorded))
    if not step and pick.nodes == previous:
        # no rank of the step wrote anything (srun could not start it, or every rank died in its imports) and
        # nothing is different now: the same step on the same nodes would fail the same way
        return fallback("the step wrote no event and no node changed (srun could not start it?)",
                        sorted(set(hard) | recorded))
    last_progress, failed_at = _times(step)
    detection = (failed_at - last_progress) if failed_at is not None and last_progress is not None else None
    teardown = started - (failed_at if failed_at is not None else (last_progress or started))
    addr = node_address(pick.nodes[0], runner, resolve)
    log = EventLog(paths.events, job_id=job_id, restart_count=restart, clock=clock)
    cause = cause_of(step, lost)
    event = log.emit(EVENT, cause=cause, detail=verdict.why[:300], slurm_restart=slurm_restart,
                     next_restart_count=restart + 1, failed_nodes=previous, nodes=pick.nodes, master_addr=addr,
                     avoided=pick.avoided, spare_used=pick.spare_used, suspects_kept=pick.suspects_kept,
                     used=used + 1, budget=budget, spares_left=max(0, len(allocation) - len(hard) - need),
                     phases={"detection_s": _round(detection), "teardown_s": _round(teardown),
                             "queue_wait_s": 0.0, "health_check_s": _round(health_s)})
    why = (f"{cause}: relaunched in the job on {','.join(pick.nodes)} ({used + 1} of {budget} in-job restarts)"
           + (f"; spare {','.join(pick.spare_used)} replaces {','.join(h for h in previous if h not in pick.nodes)}"
              if pick.spare_used else "")
           + (f"; avoided {', '.join(f'{h} ({w})' for h, w in pick.avoided.items())}" if pick.avoided else ""))
    return Decision("relaunch", why, EXIT_RELAUNCH, pick.nodes, addr, event)


def _round(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(max(0.0, float(x)), 3)


def _record(run_dir: Path, hosts: Sequence[str], why: Mapping[str, str], job_id: str,
            clock: Callable[[], float]) -> None:
    """Record failed nodes (the next submission and a requeue exclude them); each host once."""
    known = set(recorded_hosts(run_dir))
    for h in dict.fromkeys(hosts):
        if h and h not in known:
            policy.record_failed_node(run_dir, h, f"in-job: {why.get(h, 'failed')}", clock=clock, job_id=job_id)
            known.add(h)


def first(run_dir: Path, env: Mapping[str, str], need: int, runner: Runner = default_runner,
          resolve: Callable[[str], str] = socket.gethostbyname) -> tuple[list[str], str]:
    """The first step's nodes: ``need`` of the allocation, recorded failed nodes and nodes Slurm reports bad
    last (kept only when there are not enough others), and the rendezvous address of the first."""
    allocation = Slurm(runner).hostnames(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    avoid = set(recorded_hosts(run_dir)) | set(bad_states(allocation, runner))
    order = [h for h in allocation if h not in avoid] + [h for h in allocation if h in avoid]
    nodes = order[:need]
    return nodes, (node_address(nodes[0], runner, resolve) if nodes else "")


# ---- the command line of the batch script ---------------------------------------------------------

USAGE = ("usage: python -m recovery.injob offset RUN_DIR | first RUN_DIR --nodes N | "
         "next RUN_DIR --rc RC --nodes HOSTS --budget K [--gpus G] [--no-requeue] | probe RUN_DIR [--gpus G]")


def _opt(args: list[str], name: str, default: Optional[str] = None) -> Optional[str]:
    if name in args:
        i = args.index(name)
        if i + 1 < len(args):
            return args[i + 1]
    return default


def main(argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None,
         runner: Runner = default_runner, out=print) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ if env is None else env)
    if len(args) < 2 or args[0] not in ("offset", "first", "next", "probe"):
        print(USAGE, file=sys.stderr)
        return 2
    cmd, run_dir = args[0], Path(args[1])
    try:
        gpus = int(_opt(args, "--gpus", "0") or 0)
        if cmd == "probe":
            out(probe_line(run_dir, env, gpus=gpus))
            return 0
        if cmd == "offset":
            out(str(offset(run_dir, env.get("SLURM_JOB_ID") or "")))
            return 0
        if cmd == "first":
            nodes, addr = first(run_dir, env, int(_opt(args, "--nodes", "0") or 0), runner)
            if nodes:
                out(f"{','.join(nodes)} {addr}")
            return 0
        rc_text = _opt(args, "--rc")
        rc = int(rc_text) if rc_text not in (None, "") and rc_text.lstrip("-").isdigit() else None
        step_nodes = [h for h in (_opt(args, "--nodes", "") or "").split(",") if _HOST.match(h)]
        budget = int(_opt(args, "--budget", "0") or 0)
    except ValueError as e:
        print(f"slurmtron in-job: {e}; {USAGE}", file=sys.stderr)
        return 2
    if argv is None:  # the real CLI: the requeue of the fallback SIGTERMs every process of the job, this one too
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    d = decide(run_dir, env, rc=rc, step_nodes=step_nodes, budget=budget, runner=runner,
               requeue_allowed="--no-requeue" not in args, gpus=gpus)
    print(f"slurmtron in-job: {d.action}: {d.why}", file=sys.stderr, flush=True)
    if d.action == "relaunch":
        out(f"{','.join(d.nodes)} {d.master_addr}")
        return EXIT_RELAUNCH
    if d.action == "requeue":
        return policy.EXIT_REQUEUE
    return EXIT_STOP


if __name__ == "__main__":
    sys.exit(main())
