"""Rank 0's start decision, before the model is built: resume, start, or refuse, and why.

:func:`decide_start` takes the run lock, names the run, plans the resume from the verified checkpoints
(:func:`recovery.resume.plan_resume`), weighs a newer node-local set (:func:`recovery.local_sets.choose`),
honours a cancel or drain that already ended the run (:func:`recovery.stop.start_refusal`) and asks the
requeue policy (:func:`recovery.policy.start_decision`). Every input is an argument (paths, the job, the
restart count, the environment, the storage seam, the rank layout and each node's local inventory), so a test
calls it on a directory without torch or a process group; ``train.checkpointer.find_start`` gathers the
inventories, lets rank 0 call this and broadcasts the :class:`Start` it returns (a plain dataclass: it pickles).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from launch.kinds import EventKind
from launch.paths import RunPaths
from recovery import lock, policy, stop
from recovery.events import read_events
from recovery.identity import run_identity
from recovery.local_sets import Inventory, LocalChoice, choose, room_notices
from recovery.policy import Decision
from recovery.resume import Resume, committed_steps, plan_resume
from recovery.storage import LocalStorage, read_json_dict
from recovery.trust import trusts_shared


@dataclass
class Start:
    """Rank 0's verdict before the model is built, as every rank receives it."""

    resume: Resume  # the newest verified checkpoint (path None: start from scratch)
    decision: Decision  # may this attempt train; when not, the reason and its exit code
    notices: list = field(default_factory=list)  # visible fallbacks: each a WARNING line and an event
    identity: Optional[dict] = None  # whose checkpoints these are (recovery.identity.run_identity)
    local: Optional[LocalChoice] = None  # its step set: resume from that local set (train/local_ckpt.py)
    local_nodes: Optional[list] = None  # every rank's node when the local tier is on (set after the broadcast)
    local_saves_off: Optional[str] = None  # why this attempt makes no local saves (a node's directory too small)
    # when ``local`` is chosen: the global checkpoint it was weighed against (path None: none), where every rank goes
    # if reading the local set fails its SHA-256 after this decision (train/local_ckpt.py load_start)
    fallback: Optional[Resume] = None
    # rank 0's hold on the run (recovery.lock.Acquired); the caller keeps it for the attempt, it is not broadcast
    run_lock: Optional[lock.Acquired] = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return bool(self.decision.ok)


def refused(reason: str, detail: str, notices: list, code: Optional[int] = None,
            resume: Optional[Resume] = None, identity: Optional[dict] = None,
            local: Optional[LocalChoice] = None, run_lock: Optional[lock.Acquired] = None) -> Start:
    """A start that may not train: ``reason`` with its final exit code (``recovery.policy.FINAL_REASONS``) unless
    ``code`` says otherwise."""
    code = policy.FINAL_REASONS[reason] if code is None else code
    return Start(resume or Resume(None, None), Decision(False, reason, code, detail), notices, identity, local,
                 run_lock=run_lock)


def decide_start(paths: RunPaths, job: Any, *, restart: int, job_id: Optional[str], env: Mapping[str, str],
                 storage: LocalStorage, world: int, layout: Any,
                 inventories: Optional[list[Inventory]] = None) -> Start:
    """Rank 0: take the run lock, decide from the checkpoints found (resume, start, or refuse) and ask the
    requeue policy. ``job`` is the composed ``launch.config.Job`` (its run name, model and ``training``);
    ``restart`` this attempt's restart count; ``inventories`` every node's verified local sets (None: the local
    tier is off). The lock taken is :attr:`Start.run_lock` (None when another writer holds the run)."""
    notices: list = []
    try:
        held = lock.acquire(paths.lock, lock.me_from_env(env), handed_by=env.get(lock.HANDOVER_ENV) or None)
    except lock.RunLocked as e:
        return refused("run_locked", str(e), notices)
    try:
        return _decide_held(paths, job, held, notices, restart=restart, job_id=job_id, env=env, storage=storage,
                            world=world, layout=layout, inventories=inventories)
    except BaseException:
        held.release()  # the caller never gets the lock to release at the attempt's end
        raise


def _decide_held(paths: RunPaths, job: Any, held: lock.Acquired, notices: list, *, restart: int,
                 job_id: Optional[str], env: Mapping[str, str], storage: LocalStorage, world: int, layout: Any,
                 inventories: Optional[list[Inventory]]) -> Start:
    if held.taken_over is not None:
        old = held.taken_over
        notices.append({"event": EventKind.RUN_LOCK_TAKEOVER, "holder": old.describe(), "reason": held.why,
                        "message": f"taking over the run lock of {old.describe()}: {held.why}"})
    identity = run_identity(job, paths.run_dir)
    fresh = restart == 0
    scratch = bool(job.training.restart_from_scratch) and fresh
    plan = plan_resume(paths.checkpoints, identity=identity, storage=storage,
                       committed=committed_steps(read_events(paths.events)), restart_from_scratch=scratch,
                       trust_shared=trusts_shared(env))
    if scratch:
        notices.append({"event": EventKind.START_OVER, "reason": "training.restart_from_scratch=true",
                        "message": "training.restart_from_scratch=true: starting at step 0 (old checkpoints are "
                                   "in quarantine/, not deleted)"})
    notices += plan.notices
    if plan.action == "refuse":
        return refused(plan.reason, plan.detail, notices, run_lock=held)
    res = Resume(plan.path, plan.step, plan.meta)
    local = None
    saves_off = None
    fallback = None
    if inventories is not None and not scratch:  # the newest complete verified local set, if newer (one source)
        local = choose(res.step, inventories, world=world, layout=layout, identity=identity)
        notices += local.notices
        if local.step is not None:
            fallback, res = res, Resume(None, local.step, local.meta)
    if inventories is not None:  # every node's directory must hold what the planner says (Slurm: first seen here)
        short = room_notices(inventories, read_json_dict(paths.local_plan, storage), res.step)
        notices += short
        saves_off = short[0]["message"] if short else None
    ended = stop.start_refusal(paths.stop_request, res.step, job_id)  # a cancel or a drain ended the run
    if ended:
        return refused(ended[0], ended[1], notices, code=policy.EXIT_COMPLETED, resume=res, identity=identity,
                       local=local, run_lock=held)
    decision = policy.start_decision(paths.run_dir, restart, res.step, job.training, job_id=job_id)
    return Start(res, decision, notices, identity, local, local_saves_off=saves_off, fallback=fallback,
                 run_lock=held)
