"""The compute-node entry: ``python -m train.worker RUN_DIR`` (one process per rank).

Reads ``RUN_DIR/config.yaml`` (the resolved composed job), finds its place from Slurm's or
torchrun's variables (:mod:`launch.dist_env`) and builds its :class:`train.context.RankContext`,
initialises torch.distributed and Megatron-Core's ``parallel_state``
(:func:`train.distributed.init_distributed`), finds the newest *verified* checkpoint and asks
the requeue policy whether this attempt may train (:func:`train.checkpointer.find_start`),
builds the model, resumes and trains (:mod:`train.train_loop`, with a
:class:`train.checkpointer.Checkpointer` for every save). A stop signal only sets a flag; at the next step
boundary all ranks agree, save, commit, and exit 42 after rank 0 asked for a requeue.

Start-up: before its heavy imports every rank applies the start-up rule
(:func:`recovery.policy.startup_decision`: exit 3 after ``training.zero_progress_restarts`` attempts that failed
before their first step); a failure before the start decision (an import, the version check, the process group
join) is recorded under ``startup/`` (:mod:`recovery.startup_failures`), said in one line and exits 1.

Exit codes: the one table is :data:`recovery.exit_codes.EXIT_CODES` (name, code, final or not, meaning;
``docs/recovery.md`` shows it). From it: 0 completed, 1 crash, 3 zero-progress guard, 4 max restarts, 5 no
loadable checkpoint, 6 foreign checkpoint, 7 storage error, 8 disk full, 9 run locked, 10 unsupported software,
11 stopped on a NaN, 12 unsafe checkpoint, 13 shared checkpoint, 14 bad config, 15 checkpoint mismatch, 16 replay
mismatch, 17 the budget is spent (checkpointed), 18 out of GPU memory, 42 checkpointed on a stop signal and requeue
requested. A hang is ended by the rank's watcher (:mod:`recovery.watchdog`): SIGKILL.

Test hooks, environment switches read by :class:`train.context.Hooks` (never set them in production):

``SLURMTRON_TEST_STEP_SLEEP_S``
    sleep this many seconds in every step, so a test's signal lands mid-run;
``SLURMTRON_TEST_SAVE_SLEEP_S``
    rank 0 sleeps this long inside every save, after all shards are written and before the
    commit, so a test can kill the job mid-save (a torn checkpoint).

``SLURMTRON_TEST_PARAM_DIGEST``
    when set, every rank prints ``parameter digest rank R: <sha256>`` of its local
    parameters at the end, so a test can show data-parallel replicas are identical.

``SLURMTRON_TEST_FAIL_AT_ITER``
    raise at this iteration on every rank (a deterministic crash).

``SLURMTRON_TEST_HANG_AT_ITER`` (with ``SLURMTRON_TEST_HANG_RANK``, default 0, ``SLURMTRON_TEST_HANG_IN``, ``_HANG_S``)
    in the first attempt only, that rank hangs (sleeps ``_HANG_S``, default 3600 s) in iteration N:
    ``data`` (default) while reading its first sample of the step, outside any collective;
    ``save`` inside the save of step N, after the shards, before the commit;
``SLURMTRON_TEST_NAN_AT_ITER``
    the global batch iteration N reads in an uninterrupted run gets a NaN loss mask;
``SLURMTRON_TEST_SLOW_RANK`` = ``R:S``
    rank R spends S more CPU seconds per step reading its samples (a slower device).
``SLURMTRON_TEST_SAVE_EIO`` = ``K``
    the first K commits of each attempt fail with EIO on rank 0 (sync and async alike).
``SLURMTRON_TEST_ASYNC_HANG_AT`` = ``N``
    the forked asynchronous writer of step N sleeps ``SLURMTRON_TEST_HANG_S`` before writing (a stuck writer).
``SLURMTRON_TEST_OOM_AT_ITER``
    every rank raises ``torch.cuda.OutOfMemoryError`` at iteration N (the OOM forensics without a GPU).
``SLURMTRON_TEST_LOCAL_RESTORE_GATE`` = ``PATH``
    every rank reads the local set the start chose only once ``PATH`` exists (so a test can damage it in between).
``SLURMTRON_TEST_OVERFLOW_AT_ITER`` = ``N[,M...]``
    after the backward pass of those iterations every rank sets its gradients to inf: with fp16 a
    loss-scale overflow (the step is skipped and the scale lowered), otherwise a non-finite grad norm.

Everything runs under ``if __name__ == "__main__":``: dist_checkpointing's writer starts a
helper process that re-imports the main module.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any, Mapping, Optional

from launch import dist_env
from launch.dist_env import PG_TIMEOUT_S
from launch.hf_config import hf_dir
from launch.kinds import EventKind
from launch.paths import RunPaths
from launch import attempts
from recovery import exclusion, policy, startup_failures
from recovery import stop as stopping
from recovery.events import EventLog, read_events
from recovery.exit_codes import EXIT_CRASH
from recovery.hang_report import Limits
from recovery.policy import (
    EXIT_BAD_CONFIG, EXIT_BUDGET, EXIT_COMPLETED, EXIT_NAN, EXIT_OOM, EXIT_REPLAY_MISMATCH, EXIT_STORAGE, FINAL_REASONS,
    restart_count_from_env, slurm_restart_count,
)
from recovery.signals import StopFlag, ignore_stop_signals, install_handlers
from recovery.start import Start
from recovery.start_check import complete_line
from recovery.startup_watch import StartupWatch
from recovery.stop import Judge
from recovery.watchdog import COLLECT_S, DUMP_WAIT_S, Heartbeat, hang_dir
from train import budget as budgets
from train import memory
from train.checkpointer import Checkpointer, SaveFailed, announce, find_start, vet_resume
from train.context import Hooks, HookedSource, RankContext, broadcast
from train.previous_slice import note_previous_slice
from train.replay_parity import ReplayParity, numerics_of, recipe_of
from train.stragglers import LiveChecks

# Imported where they are used: torch and Megatron-Core (train_loop, local_ckpt, data, megatron_ckpt, hf_bridge,
# nan_guard), the composition and the tracking back-ends (Hydra: after the signal handlers are installed), and
# train.distributed and train.versions, which main() imports in their order before anything imports torch.

DIST_TIMEOUT_S = PG_TIMEOUT_S  # the job check compares the hang deadlines with it (launch/check_watch.py)


def param_digest(chunks: list) -> str:
    """SHA-256 over this rank's parameters (names and bytes), for replica-equality tests."""
    import hashlib

    from train.megatron_ckpt import sync_params

    sync_params(chunks)  # the weights as the last step left them, also with overlap_param_gather
    h = hashlib.sha256()
    for chunk in chunks:
        for name, p in getattr(chunk, "module", chunk).named_parameters():
            h.update(name.encode())
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: Optional[list[str]] = None, env: Optional[Mapping[str, str]] = None) -> int:
    """Run this rank; returns its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ if env is None else env)
    if len(argv) != 1:
        print("usage: python -m train.worker RUN_DIR", file=sys.stderr)
        return 2

    from launch.compose import load_job

    flag = StopFlag()
    install_handlers(flag)  # first: a signal during start-up is kept, not lost
    from train.distributed import quiet_known_warnings  # before torch or megatron is imported

    quieted = quiet_known_warnings(env)
    loaded = _load_run(argv[0], env, load_job)
    if isinstance(loaded, int):
        return loaded
    job, paths = loaded
    if (refused := _refuse_after_startup_failures(paths, env, job.training)) is not None:
        return refused
    try:  # from here to the start decision a failure is a start-up failure (recovery/startup_failures.py)
        from train.versions import refuse_unsupported  # before anything imports torch or megatron
        if (refused := refuse_unsupported(paths.run_dir, env, job.training.precision,
                                          tp_comm_overlap=job.parallelism.tp_comm_overlap)) is not None:
            return refused
        denv = dist_env.from_env(env)
    except Exception as e:  # noqa: BLE001 - recorded, one line, relaunched until the start-up rule stops it
        import traceback

        return _startup_failed(paths, env, e, traceback.format_exc(), "version check")
    if quieted and denv.rank == denv.world_size - 1:  # the rank the terminal shows
        print(quieted, flush=True)
    restart = restart_count_from_env(env)
    events = EventLog(paths.events, rank=denv.rank, job_id=env.get("SLURM_JOB_ID"), restart_count=restart,
                      enabled=denv.rank == 0, attempt=_numbered(env))
    ctx = RankContext(job=job, paths=paths, dist=denv, env=env, restart=restart, flag=flag, events=events,
                      hooks=Hooks.from_env(env))
    ctx.heartbeat = _start_watchdog(ctx)
    try:
        return _run_reporting(ctx)
    finally:
        ctx.heartbeat.close()
        if ctx.run_lock is not None:  # the attempt is over: the next writer may come
            ctx.run_lock.release()
        # The outcome is decided and durable: a late warning or SIGTERM has nothing left to stop,
        # and during interpreter shutdown Python restores the default action (terminate), which
        # would turn a completed rank into a FAILED job step.
        ignore_stop_signals()


def _numbered(env: Mapping[str, str]) -> Optional[int]:
    """The attempt's number in the run for the event log where the launcher numbered it (``cluster=local``), else
    None: the restart count is the attempt (:mod:`launch.attempts`)."""
    return policy.attempt_from_env(env) if env.get(attempts.ATTEMPT_ENV) not in (None, "") else None


def _refuse_after_startup_failures(paths: RunPaths, env: Mapping[str, str], training: Any) -> Optional[int]:
    """Every rank, before its heavy imports: the last ``training.zero_progress_restarts`` attempts of this chain all
    failed to start (:func:`recovery.policy.startup_decision`): one line, a ``zero_progress`` stop (rank 0), exit 3."""
    dec = policy.startup_decision(paths.run_dir, env, training)
    if dec.ok:
        return None
    print(f"slurmtron: refused to start: {dec.detail} (exit {dec.code}; final: not relaunched or requeued)",
          flush=True)
    try:
        rank = dist_env.rank_of(env)
        # Every rank reaches this verdict from the same records, but the first to exit gets its peers killed
        # (srun --kill-on-bad-exit), rank 0 perhaps before it decided: so the first rank of each node records the
        # final stop too (one line per node), and the requeue judge (recovery/crash.py) never takes the attempt
        # for a crash to requeue. Rank 0 also records the exit.
        if rank == 0 or dist_env.local_rank_of(env) == 0:
            log = EventLog(paths.events, rank=rank, job_id=env.get("SLURM_JOB_ID"),
                           restart_count=restart_count_from_env(env), attempt=_numbered(env))
            log.emit(EventKind.STOP, reason=dec.reason, code=dec.code, detail=dec.detail, startup=True)
            if rank == 0:
                log.emit(EventKind.EXIT, reason=dec.reason, code=dec.code, step=None)
    except (OSError, ValueError) as e:  # the refusal stands; only its record is missing
        print(f"WARNING: the refusal could not be recorded in {paths.events}: {e}", flush=True)
    return int(dec.code)


def _startup_failed(paths: RunPaths, env: Mapping[str, str], e: BaseException, tb: str, phase: str) -> int:
    """This rank failed before the start decision (an import, a version check, the process group join): record it
    (``startup/``, a ``startup_failed`` event), say it in one line (the traceback is in the record), exit 1 so the
    launcher or Slurm relaunches, until :func:`recovery.policy.startup_decision` stops the chain."""
    error = startup_failures.first_line(e)
    host = dist_env.node_name(env)
    try:
        rank, restart, attempt = dist_env.rank_of(env), restart_count_from_env(env), policy.attempt_from_env(env)
        where = startup_failures.record_startup_failure(
            paths.run_dir, job_id=env.get("SLURM_JOB_ID"), attempt=attempt, restart_count=restart, rank=rank,
            host=host, error=error, phase=phase, traceback=tb)
        log = EventLog(paths.events, rank=rank, job_id=env.get("SLURM_JOB_ID"), restart_count=restart,
                       attempt=_numbered(env))
        log.emit(EventKind.STARTUP_FAILED, host=host, error=error, phase=phase, record=str(where))
        log.emit(EventKind.STOP, reason="crash", code=EXIT_CRASH, detail=error, startup=True)
        log.emit(EventKind.EXIT, reason="error", code=EXIT_CRASH, step=None)
    except (OSError, ValueError) as exc:  # the failure stands; only its record is missing, and that is said
        print(f"rank ?: could not start on {host}: {error} (its record could not be written: {exc}; exit "
              f"{EXIT_CRASH})", flush=True)
        return EXIT_CRASH
    print(f"rank {rank}: could not start on {host} ({phase}): {error} (attempt {attempt}; traceback in {where}; "
          f"exit {EXIT_CRASH}: relaunched until training.zero_progress_restarts stops it)", flush=True)
    return EXIT_CRASH


def _load_run(run_dir: str, env: Mapping[str, str], load_job: Any) -> Any:
    """(job, paths) of ``run_dir``, or the final exit code after one line: a run directory that is missing
    (a filesystem not mounted on this node) or a ``config.yaml`` that cannot be read back into a job."""
    from pathlib import Path

    where = Path(run_dir)
    if not where.is_dir():
        what = "is not a directory" if where.exists() else "does not exist"
        print(f"slurmtron: refused to start: run directory {where} {what} (is its filesystem mounted on this "
              f"node?); nothing was written (exit {EXIT_STORAGE})", flush=True)
        return EXIT_STORAGE
    config = RunPaths.of(where).config
    try:
        job = load_job(config)
        return job, job.paths_at(run_dir)
    except Exception as e:  # binary, malformed YAML, a wrong type: the schema's own words, first line only
        said = (str(e).strip().splitlines() or [""])[0][:300]
        line = (f"{config} cannot be read back into a job ({type(e).__name__}: {said}); restore it from the run's "
                f"submission or resubmit with launch/pretrain.py")
    print(f"slurmtron: refused to start: {line} (exit {EXIT_BAD_CONFIG})", flush=True)
    _record_refusal(RunPaths.of(where).events, env, "bad_config", EXIT_BAD_CONFIG, line)
    return EXIT_BAD_CONFIG


def _record_refusal(events_path: Any, env: Mapping[str, str], reason: str, code: int, detail: str) -> None:
    """Rank 0 records a refusal before a job exists (``stop``/``exit``), so the crash requeue sees a final stop."""
    try:
        if dist_env.from_env(env).rank != 0:
            return
        log = EventLog(events_path, job_id=env.get("SLURM_JOB_ID"), restart_count=restart_count_from_env(env),
                       attempt=_numbered(env))
        log.emit(EventKind.STOP, reason=reason, code=code, detail=detail)
        log.emit(EventKind.EXIT, reason=reason, code=code, step=None)
    except (OSError, ValueError, KeyError) as e:  # the refusal stands; only its record is missing
        print(f"WARNING: the refusal could not be recorded in {events_path}: {e}", flush=True)


def _start_watchdog(ctx: RankContext) -> Any:
    """This rank's hang watcher (:mod:`recovery.watchdog`), unless ``training.watchdog.enabled=false``."""
    if not ctx.job.training.watchdog.enabled:
        return Heartbeat.disabled()
    try:
        hb = Heartbeat.start(ctx.paths.run_dir, ctx.paths.hangs, Limits.of(ctx.job.training.watchdog), rank=ctx.rank,
                             world=ctx.world, job_id=ctx.job_id, restart=ctx.restart, host=_host(ctx))
    except OSError as e:
        print(f"WARNING: hang watchdog not started ({e}); this rank runs unwatched", flush=True)
        ctx.emit(EventKind.WATCHDOG_UNAVAILABLE, detail=str(e))
        return Heartbeat.disabled()
    hb.beat("startup")
    return hb


def _host(ctx: RankContext) -> str:
    return ctx.env.get("SLURMD_NODENAME") or socket.gethostname()


def _run_reporting(ctx: RankContext) -> int:
    try:
        return _run(ctx)
    except BaseException as e:  # report every failure, then let the code say crash
        import traceback

        if _failed_to_start(ctx, e):  # imports, the process group join: one line, recorded, relaunched
            if _hang_declared(ctx):
                return _leave_to_the_watchdog(ctx, e)
            return _startup_failed(ctx.paths, ctx.env, e, traceback.format_exc(), "start-up")
        from train.megatron_ckpt import UnsafeCheckpoint  # imports Megatron-Core: only once the start is decided

        # the filesystem refused a save, or a checkpoint to load holds a pickle that could run code:
        # a named, final stop (no traceback needed)
        if isinstance(e, (SaveFailed, UnsafeCheckpoint)):
            stop = e.stop
            fields = {k: v for k, v in stop.items() if k not in ("reason", "code", "detail", "cause")}
            if isinstance(e, SaveFailed) and not e.reported:  # a stop or final save: no policy applies
                ctx.emit(EventKind.SAVE_FAILED, step=stop.get("step"), cause=stop.get("cause", stop["reason"]),
                         save="stop_or_final", go_on=False, detail=stop["detail"][:2000])
            ctx.emit(EventKind.STOP, reason=stop["reason"], code=stop["code"], detail=stop["detail"], **fields)
            ctx.emit(EventKind.EXIT, reason=stop["reason"], code=stop["code"], step=stop.get("step"))
            ctx.log(f"stopping: {stop['reason']}: {stop['detail']}")
            return int(stop["code"])
        if type(e).__name__ == "CheckpointMismatch":  # this job cannot load the run's checkpoint: final, one line
            return _refuse_mismatch(ctx, str(e))

        if memory.is_oom(e):  # a deterministic OOM does not fix itself on a requeue: forensics, then a final stop
            return _oom_stop(ctx, e)
        traceback.print_exc()
        if _hang_declared(ctx):
            return _leave_to_the_watchdog(ctx, e)
        if (code := _broken_by_the_stop_signal(ctx, e)) is not None:
            return code
        ctx.emit(EventKind.STOP, reason="crash", code=EXIT_CRASH, detail=f"{type(e).__name__}: {e}"[:2000])
        code = _requeue_away_from_faulty_node(ctx, traceback.format_exc())
        ctx.emit(EventKind.EXIT, reason="error" if code == EXIT_CRASH else "requeue", code=code, step=None)
        return code


_NAMED_STOPS = ("SaveFailed", "UnsafeCheckpoint", "CheckpointMismatch")  # final stops of their own, never start-up


def _failed_to_start(ctx: RankContext, e: BaseException) -> bool:
    """A failure before the start decision (an import, a version check, the process group join) that no stop signal
    explains and that is no named stop: a start-up failure (:func:`_startup_failed`). An import error is one even
    when a stop signal came too (srun ends the peers of a rank that failed first): no signal makes a module
    unimportable."""
    return (not ctx.decided and isinstance(e, Exception) and type(e).__name__ not in _NAMED_STOPS
            and (ctx.flag.received_at is None or isinstance(e, ImportError)))


def _oom_stop(ctx: RankContext, e: BaseException) -> int:
    """This rank ran out of GPU memory: write the forensics under ``<run_dir>/oom/`` (:mod:`train.memory`), record a
    final ``oom`` stop from this rank (rank 0 may be a healthy peer whose collective breaks next) and exit 18."""
    t = ctx.job.training
    mem = memory.sample(bool(ctx.cuda))
    files: list = []
    try:
        files = memory.oom_files(ctx.paths, ctx.job_id, ctx.restart, ctx.rank, cuda=bool(ctx.cuda),
                                 snapshot=t.oom_snapshot, s=mem)
    except Exception as exc:  # the stop stands; only its forensics are missing, and that is said
        print(f"WARNING: rank {ctx.rank}: the out-of-memory forensics could not be written under "
              f"{ctx.paths.run_dir / 'oom'} ({type(exc).__name__}: {exc})", flush=True)
    detail = memory.forensics_line(f"{type(e).__name__}: {e}", mem, memory.read_plan(ctx.paths.memory_plan))
    log = ctx.events if ctx.is_first else EventLog(ctx.paths.events, rank=ctx.rank, job_id=ctx.job_id,
                                                   restart_count=ctx.restart, attempt=ctx.events.attempt)
    log.emit(EventKind.STOP, reason="oom", code=EXIT_OOM, detail=detail[:2000], oom_rank=ctx.rank,
             files=[str(f) for f in files], **mem.fields())
    log.emit(EventKind.EXIT, reason="oom", code=EXIT_OOM, step=None)
    print(f"stopping: rank {ctx.rank}: {detail}; forensics: {', '.join(str(f) for f in files) or 'none'} "
          f"(exit {EXIT_OOM}; final: not requeued or relaunched)", flush=True)
    return EXIT_OOM


def _broken_by_the_stop_signal(ctx: RankContext, e: BaseException, make_judge: Any = None) -> Optional[int]:
    """A failure after SIGTERM/SIGINT was received (a collective broke because Slurm killed a peer in the kill
    window of a ``scancel``, a preemption, a time limit) is that signal's cause, not a crash: rank 0 asks Slurm
    (:mod:`recovery.stop`) and records the stop under the cause Slurm names; a requeue cause is requeued (from
    the newest checkpoint: no stop checkpoint was made), a cancel ends the run. Returns None (a crash, as
    before) when no such signal came or Slurm explains nothing; other ranks write nothing and exit 1."""
    import signal as signals

    signum = ctx.flag.signum
    if signum not in (signals.SIGTERM, signals.SIGINT) or not ctx.job_id:
        return None
    if not ctx.is_first:
        return EXIT_CRASH
    dec = (make_judge or _judge)(ctx).decide(signum, False)
    if dec.reason in (stopping.UNDECIDED, stopping.REQUEUE_SIGNAL, stopping.LOCAL_SIGNAL):
        return None
    evidence = (f"{type(e).__name__} after {ctx.flag.name} was received: the stop signal's cause, not a crash; "
                f"{dec.evidence}")[:2000]
    code = policy.EXIT_REQUEUE if dec.requeue else policy.EXIT_COMPLETED
    ctx.emit(EventKind.STOP, reason=dec.reason, requeue=dec.requeue, evidence=evidence, step=None, code=code,
             detail=f"{type(e).__name__}: {e}"[:500], saved=False)
    ctx.log(f"this attempt ended on {ctx.flag.name} ({dec.reason}) before its stop checkpoint was durable: "
            f"{type(e).__name__}; the newest committed checkpoint is where the run continues")
    if dec.requeue:
        code = policy.after_stop_save(signum, ctx.env, requeue_allowed=ctx.job.cluster.requeue_allowed,
                                      events=ctx.events, requeued_by_slurm=dec.requeued_by_slurm)
        ctx.emit(EventKind.EXIT, reason="requeue", code=code, step=None)
        return code
    if dec.reason in (stopping.USER_STOP, stopping.USER_CANCEL):
        stopping.mark_stopped(ctx.paths.stop_request, dec.reason, None, ctx.job_id)
    ctx.emit(EventKind.EXIT, reason="stopped", code=code, step=None)
    return code


def _hang_declared(ctx: RankContext) -> bool:
    """Has a hang watchdog declared a hang in this attempt (its ``trigger.json``)?"""
    if not ctx.job.training.watchdog.enabled:
        return False

    return (hang_dir(ctx.paths.hangs, ctx.job_id, ctx.restart) / "trigger.json").exists()


def _leave_to_the_watchdog(ctx: RankContext, e: BaseException) -> int:
    """This rank failed while the watchdogs handle a declared hang (a collective broke because the hung peer
    died during its stack dump): the hang is the cause, and rank 0's watcher records it (``hang``, ``stop``,
    ``exit``). No ``crash`` stop is recorded; the rank waits for its watcher to end it as it ends every rank."""
    ctx.log(f"this rank failed ({type(e).__name__}) after the hang watchdog declared a hang in this attempt; "
            f"the watchdog records the stop (see {ctx.paths.hangs})")
    time.sleep(COLLECT_S + 2 * DUMP_WAIT_S)  # the watcher kills this rank once the reports are collected
    return EXIT_CRASH


def _run(ctx: RankContext) -> int:
    from train.distributed import distributed

    ctx.phase(f"attempt {_attempt_no(ctx)} of run {ctx.job.run.name}: importing torch and Megatron-Core, then joining "
              f"the {ctx.world} ranks' process group at {ctx.dist.master_addr}:{ctx.dist.master_port}")
    code = None
    with distributed(ctx.job, ctx.dist, timeout_s=DIST_TIMEOUT_S, checkpoint_helpers=True) as dev:
        ctx.cuda, ctx.device, ctx.writer_warmup = dev.cuda, dev.device, dev.writer_warmup
        try:
            code = _train(ctx)
            return code
        finally:
            ctx.beat("done")
            if code is not None:
                ctx.phase(f"attempt {_attempt_no(ctx)} ends (exit {code}): closing the process group")


def _attempt_no(ctx: RankContext) -> int:
    """This attempt's number in the run (the rank logs' name on cluster=local; the restart count on Slurm)."""
    return ctx.restart if ctx.events.attempt is None else int(ctx.events.attempt)


def _train(ctx: RankContext) -> int:
    """Resume or start, train to the end or to a stop signal, and say how this attempt ends."""
    from train import train_loop

    job = ctx.job
    iters = train_loop.train_iters(job)
    ctx.phase(f"{ctx.world} rank(s) joined ({'cuda' if ctx.cuda else 'cpu'}, layout {job.layout_label}-dp{job.dp}); rank 0 looks for "
              f"the newest verified checkpoint in {ctx.paths.checkpoints}")
    start = find_start(ctx)  # rank 0 searches and decides, every rank follows
    ctx.decided = True  # the start-up is over: a failure from here on is the zero-progress guard's
    if not start.ok and start.decision.reason == "run_locked":
        return _refuse_locked(ctx, start)

    ctx.emit(EventKind.JOB_START, world_size=ctx.world, layout=ctx.layout,
             layout_label=f"{job.layout_label}-dp{job.dp}", train_iters=iters, nodes=ctx.dist.nodes,
             source=ctx.dist.source, numerics=numerics_of(job, ctx.world, bool(ctx.cuda)), recipe=recipe_of(job))
    if not start.ok:
        return _refuse_start(ctx, start)
    _note_previous_slice(ctx, start)
    watch = _startup_watch(ctx)
    try:
        return _train_started(ctx, start, iters, watch)
    finally:
        if watch is not None:
            watch.stop()


def _note_previous_slice(ctx: RankContext, start: Start) -> None:
    """Rank 0: the slice before this one ended TIMEOUT without a word is a WARNING and a ``previous_slice_timeout``
    event with the steps lost (:mod:`train.previous_slice`); this slice trains on either way."""
    if not (ctx.is_first and ctx.job_id):
        return

    try:
        note_previous_slice(ctx, start.resume.step)
    except Exception as exc:  # a diagnosis of the previous slice never stops this one
        print(f"WARNING: could not check how the previous slice ended ({type(exc).__name__}: {exc})", flush=True)


def _startup_watch(ctx: RankContext) -> Any:
    """Rank 0, run lock held, until the training loop begins: the time-limit warning during start-up requeues
    the job at once, without saving (:mod:`recovery.startup_watch`)."""
    if not (ctx.is_first and ctx.job_id and ctx.job.cluster.requeue_allowed):
        return None

    def requeue_now(signum: int) -> None:
        dec = _judge(ctx).decide(signum, False)
        ctx.emit(EventKind.STOP, reason=dec.reason, requeue=True, step=None, code=policy.EXIT_REQUEUE, saved=False,
                 evidence=(f"{ctx.flag.name} came during start-up, before the first step: nothing new to save; "
                           f"requeued at once without saving; {dec.evidence}")[:2000])
        ctx.log(f"{ctx.flag.name} ({dec.reason}) during start-up: requeueing now without saving; the next slice "
                f"resumes from the newest checkpoint")
        policy.after_stop_save(signum, ctx.env, requeue_allowed=True, events=ctx.events,
                               requeued_by_slurm=dec.requeued_by_slurm)

    return StartupWatch(ctx.flag, requeue_now).start()


def _train_started(ctx: RankContext, start: Start, iters: int, watch: Any = None) -> int:
    """The run lock is held and the start decided: load, build, and train."""
    if ctx.hooks.startup_sleep_s > 0:  # test hook: a start-up slower than the slice allows
        time.sleep(ctx.hooks.startup_sleep_s)
    from train import local_ckpt, tracking, train_loop  # torch; tracking: launch.config (Hydra)
    from train.data import build_source, build_validation_source, describe, describe_line

    job, t = ctx.job, ctx.job.training
    from train.data import start_refusal

    if (refused := start_refusal(job.data, job.cluster.data_root)) is not None:
        return _refuse_data(ctx, refused)
    vet_resume(ctx, start)
    if start.resume.step is not None and start.resume.step >= iters:  # nothing to train: no model, no data
        ctx.log(complete_line(start.resume.step, iters, job.run.name).replace("no rank started", "nothing built"))
        ctx.emit(EventKind.EXIT, reason="completed", code=EXIT_COMPLETED, step=start.resume.step)
        return EXIT_COMPLETED

    ctx.phase(f"building the model ({job.model.num_layers} layers, hidden {job.model.hidden_size}) and optimizer")
    from train.hf_bridge import HFWeightsError

    hf_weights = _hf_weights(ctx, start)
    try:
        parts = train_loop.build_training(job, iters, cuda=ctx.cuda, device=ctx.device, hf_weights=hf_weights)
    except HFWeightsError as e:
        return _refuse_hf_weights(ctx, str(e))
    if hf_weights is not None:
        ctx.log(f"initialised every weight from the Hugging Face model in {hf_weights} (training.init_from)")
        ctx.emit(EventKind.INIT_FROM, source=str(hf_weights), step=0)
    ckpt = Checkpointer(ctx, parts, start.identity)
    ckpt.local = local_ckpt.tier_for(ctx, parts, start)  # None unless training.local_checkpoint is on
    state = local_ckpt.load_start(ctx, ckpt, start, ckpt.local)
    if tracking.is_tracking_rank():  # one rank writes TensorBoard/W&B; it purges steps past the resumed one
        ctx.tracker = tracking.open_tracker(job, ctx.paths, resumed_step=state.step,
                                            warn=lambda line: print(line, flush=True), emit=ctx.emit)
        ctx.tracker.text(state.step + 1, f"attempt {ctx.restart} (job {ctx.job_id or 'local'}) starts at step "
                                         f"{state.step + 1} on {ctx.world} ranks, layout {ctx.layout}")
    elif ctx.is_last and (line := tracking.tensorboard_missing(job)):  # the terminal shows the last rank only
        ctx.log(line)
    root, num_samples = job.cluster.data_root, iters * t.global_batch_size
    cached = f" (sample indexes are cached in {ctx.paths.data_cache})" if job.data.kind == "indexed" else \
        " (synthetic tokens, generated per step: nothing cached)"
    ctx.phase(f"building the data: {num_samples} samples{cached}")
    source = build_source(job.data, job.model, num_samples, ctx.paths.data_cache, root)
    data_info = describe(job.data, source, num_samples, state.consumed_samples, root)
    ctx.log(describe_line(data_info))
    if ctx.is_first and state.step > 0:
        _warn_data_changed(ctx, data_info, state.step)
    ctx.emit(EventKind.DATA, step=state.step, **data_info)
    valid = None
    if t.eval_interval > 0:
        valid = build_validation_source(job.data, job.model, num_samples, t.eval_iters * t.global_batch_size,
                                        ctx.paths.data_cache, root)
    if ctx.hooks.touch_data:
        source = HookedSource(source, ctx.hooks, ctx.rank, ctx.restart, t.global_batch_size,
                              t.global_batch_size // job.dp)
    live = _live_checks(ctx)
    nan_hooks = None
    if t.nan_guard.hooks:
        from train.nan_guard import NanHooks

        nan_hooks = NanHooks(parts.chunks, lambda where: print(
            f"WARNING: rank {ctx.rank}: first non-finite value in the {where}", flush=True))
    ctx.beat("train", state.step)
    if watch is not None:  # from here the step boundary handles the warning (and saves what was trained)
        watch.stop()
    judge = _judge(ctx) if ctx.is_first else None
    replay = ReplayParity(ctx, state)
    ckpt.hold_saves = replay.pending

    memory.start_history(bool(ctx.cuda), t.oom_snapshot)

    guard = budgets.build(ctx, iters)
    ctx.phase(f"training from step {state.step + 1} to {iters}; the first step is slower (warm-up)")
    try:
        result = train_loop.run_loop(ctx, parts, ckpt, source, state, iters, valid, judge, live=live,
                                     nan_hooks=nan_hooks, replay=replay, budget=guard)
        replay.finish()
        ckpt.hold_saves = False
        end = describe(job.data, source, num_samples, result.state.consumed_samples, root)
        ctx.emit(EventKind.DATA_POSITION, step=result.state.step, consumed_samples=result.state.consumed_samples,
                 consumed_per_source=[s["consumed"] for s in end.get("sources", [])])
        _live_summary(ctx, result, live)
        return _finish(ctx, ckpt, parts, result, judge)
    except BaseException as e:
        ckpt.abandon(type(e).__name__)  # a save in flight that dies with this attempt is said, not silent
        raise
    finally:  # also after a crash: what was written is flushed
        if ctx.tracker is not None:
            ctx.tracker.close()
            ctx.tracker = None


def _finish(ctx: RankContext, ckpt: Checkpointer, parts, result, judge=None) -> int:
    """After a stop: requeue or end as rank 0's judge decided; else save the final checkpoint and say the run
    completed."""
    if ctx.hooks.param_digest:
        print(f"parameter digest rank {ctx.rank}: {param_digest(parts.chunks)}", flush=True)
    if result.reason != "completed":
        ckpt.close()  # an asynchronous save in flight is made durable before the stop (a stop's save did it)

    if result.reason == "nan":
        ctx.emit(EventKind.STOP, reason="nan", code=EXIT_NAN, detail=result.detail)
        ctx.emit(EventKind.EXIT, reason="nan", code=EXIT_NAN, step=result.state.step)
        ctx.log(f"stopping: {result.detail}; nothing non-finite was applied or saved; not requeued")
        return EXIT_NAN

    if result.reason == "replay_mismatch":
        code = EXIT_REPLAY_MISMATCH
        ctx.emit(EventKind.STOP, reason="replay_mismatch", code=code, detail=result.detail[:2000])
        ctx.emit(EventKind.EXIT, reason="replay_mismatch", code=code, step=result.state.step)
        ctx.log(f"stopping: replay_mismatch (exit {code}, final: not requeued or relaunched); nothing was deleted: "
                f"inspect the checkpoint this attempt loaded, or set training.replay.on_mismatch=rollback|warn")
        return code

    if result.reason == "budget":
        ctx.emit(EventKind.STOP, reason="budget", code=EXIT_BUDGET, detail=result.detail, step=result.state.step)
        ctx.emit(EventKind.EXIT, reason="budget", code=EXIT_BUDGET, step=result.state.step)
        ctx.log(f"stopping: {result.detail}")
        return EXIT_BUDGET

    if result.reason == "signal":
        return _after_stop(ctx, result, judge)
    ckpt.save_final(result.state)
    ctx.emit(EventKind.TRAIN_END, step=result.state.step, consumed_samples=result.state.consumed_samples)
    ctx.emit(EventKind.EXIT, reason="completed", code=EXIT_COMPLETED, step=result.state.step)
    return EXIT_COMPLETED


def _live_checks(ctx: RankContext) -> Any:
    """The straggler and throughput checks (:mod:`train.stragglers`); collective: every rank builds one."""
    import torch
    import torch.distributed as dist

    hosts = [None] * ctx.world
    dist.all_gather_object(hosts, _host(ctx))

    def gather(row: list) -> list:
        mine = torch.tensor(row, dtype=torch.float64, device=ctx.device)
        out = [torch.zeros_like(mine) for _ in range(ctx.world)]
        dist.all_gather(out, mine)
        return [x.tolist() for x in out]

    return LiveChecks(ctx.job.training.stragglers, ctx.rank, ctx.world, hosts, gather, ctx.emit, ctx.log)


def _live_summary(ctx: RankContext, result: Any, live: Any) -> None:
    """End of the attempt: what the live checks cost (timed, against the median step) and the repeated stragglers."""
    live_s = result.live_s + ctx.heartbeat.seconds
    overhead = live_s / max(1, result.steps_run) / result.median_step_s if result.median_step_s else 0.0
    repeated = live.summary()
    ctx.log(f"live checks: {live_s * 1000:.1f} ms on rank {ctx.rank} over {result.steps_run} step(s) (watchdog "
            f"heartbeats, straggler all-gathers), {overhead * 100:.2f}% of this attempt's median step "
            f"{result.median_step_s * 1000:.1f} ms" + ("; repeated stragglers: " + ", ".join(
                f"rank {x['rank']} on {x['host']} ({x['intervals']} intervals)" for x in repeated) if repeated else ""))
    ctx.emit(EventKind.LIVE_CHECKS, seconds=live_s, steps=result.steps_run, median_step_s=result.median_step_s,
             overhead=overhead, repeated_stragglers=repeated)


def _warn_data_changed(ctx: RankContext, now: dict, step: int) -> None:
    """Rank 0, on resume: a data configuration other than the previous attempt's is a WARNING and an event."""
    from train.data import data_changes

    before = [e for e in read_events(ctx.paths.events) if e.get("event") == EventKind.DATA]
    changes = data_changes(before[-1] if before else None, now)
    if changes:
        print(f"WARNING: the data changed since the previous attempt ({'; '.join(changes)}): from step {step} on the "
              "run reads other samples than an uninterrupted run would", flush=True)
        ctx.emit(EventKind.DATA_CHANGED, step=step, changes=changes)


def _refuse_data(ctx: RankContext, refused: dict) -> int:
    """The job's data or tokenizer cannot be used on this node: a final stop, one line, no traceback."""
    code = FINAL_REASONS[refused["reason"]]
    print(f"refused to start: {refused['detail']}", flush=True)
    ctx.emit(EventKind.STOP, reason=refused["reason"], code=code, detail=refused["detail"])
    ctx.emit(EventKind.EXIT, reason=refused["reason"], code=code, step=None)
    return code


def _hf_weights(ctx: RankContext, start: Start) -> Any:
    """``training.init_from=hf:DIR`` applies to a run with no checkpoint only: a resume loads the run's own."""
    directory = hf_dir(ctx.job.training.init_from)
    if directory is None:
        return None
    if start.resume.path is not None:
        ctx.log(f"training.init_from={ctx.job.training.init_from} is not used: resuming from the run's own "
                f"checkpoint {start.resume.path}")
        return None
    return directory


def _refuse_hf_weights(ctx: RankContext, detail: str) -> int:
    """The Hugging Face weights of training.init_from cannot initialise this model: a final stop on every rank
    (each read all the tensors, so all refuse together), one line, no traceback."""
    code = FINAL_REASONS["bad_config"]
    ctx.log(f"refused to start: training.init_from: {detail} (exit {code}; final: not relaunched or requeued)")
    ctx.emit(EventKind.STOP, reason="bad_config", code=code, detail=detail[:2000])
    ctx.emit(EventKind.EXIT, reason="bad_config", code=code, step=None)
    return code


def _refuse_mismatch(ctx: RankContext, detail: str) -> int:
    """The run's checkpoint cannot be loaded by this job (the other optimizer type): a final stop on every rank
    (no relaunch, no requeue: another attempt would meet the same checkpoint), one line, no traceback."""
    code = FINAL_REASONS["checkpoint_mismatch"]
    ctx.log(f"refused to start: {detail} (exit {code}; final: not relaunched or requeued)")
    ctx.emit(EventKind.STOP, reason="checkpoint_mismatch", code=code, detail=detail[:2000])
    ctx.emit(EventKind.EXIT, reason="checkpoint_mismatch", code=code, step=None)
    return code


def _refuse_locked(ctx: RankContext, start: Start) -> int:
    """Another live attempt holds the run lock: this process is not the run's writer, so it writes nothing into
    the run (no event: the holder's event log, and the status and report read from it, stay the holder's). The
    refusal is this attempt's log line and its exit code."""
    dec = start.decision
    ctx.events.enabled = False  # nothing later in this process may write into the holder's event log either
    ctx.log(f"not starting: {dec.reason}: {dec.detail} (nothing written to {ctx.paths.events.name})")
    return int(dec.code)


def _refuse_start(ctx: RankContext, start: Start) -> int:
    """The requeue policy said no (zero progress, too many restarts): say why, exit with its code."""
    announce(ctx, start)
    dec = start.decision
    ctx.emit(EventKind.STOP, reason=dec.reason, code=dec.code, detail=dec.detail)
    ctx.emit(EventKind.EXIT, reason=dec.reason, code=dec.code, step=start.resume.step)
    ctx.log(f"not starting: {dec.reason}: {dec.detail}")
    return int(dec.code)


def _judge(ctx: RankContext):
    """Rank 0's stop judge: polls the drain request file, asks Slurm who stopped the job (recovery/stop.py)."""
    # Slurm's own count (not this step's, which adds the in-job relaunches): "Slurm already requeued the job"
    # compares it with scontrol's Restarts=
    return Judge(ctx.env, restart_count=slurm_restart_count(ctx.env), lead_s=ctx.job.training.signal_lead_time_s,
                 received_at=lambda: ctx.flag.received_at, stop_file=ctx.paths.stop_request)


def _after_stop(ctx: RankContext, result, judge) -> int:
    """The stop checkpoint is committed: rank 0 decides who stopped the run (:mod:`recovery.stop`), every
    rank follows. A requeue (preemption, time limit, node failure, ``scancel --signal=USR2``) exits 42
    after ``scontrol requeue``; the user's cancel or drain, or a stop Slurm cannot explain, ends the job
    (exit 0) and is not requeued."""
    step = result.state.step
    dec = broadcast(judge.decide(result.signum, result.requested).as_dict() if judge is not None else None)
    ctx.emit(EventKind.STOP, reason=dec["reason"], requeue=dec["requeue"], evidence=dec["evidence"], step=step,
             code=policy.EXIT_REQUEUE if dec["requeue"] else policy.EXIT_COMPLETED)
    if dec["requeue"]:
        code = policy.EXIT_REQUEUE
        if ctx.is_first:
            code = policy.after_stop_save(result.signum, ctx.env, requeue_allowed=ctx.job.cluster.requeue_allowed,
                                          events=ctx.events, step=step,
                                          requeued_by_slurm=bool(dec.get("requeued_by_slurm")),
                                          run_dir=ctx.paths.run_dir)
            _exclude_recorded_nodes(ctx)
        code = int(broadcast(code))
        ctx.emit(EventKind.EXIT, reason="requeue", code=code, step=step)
        return code
    if dec["reason"] == stopping.UNDECIDED:
        ctx.log(f"WARNING: not requeueing: {dec['evidence']}; resubmit the same run.name to continue")
    else:
        ctx.log(f"stopped at iteration {step} ({dec['reason']}): not requeueing; resubmit the same run.name to "
                f"continue")
    if ctx.is_first and dec["reason"] in (stopping.USER_STOP, stopping.USER_CANCEL):
        stopping.mark_stopped(ctx.paths.stop_request, dec["reason"], step, ctx.job_id)
    ctx.emit(EventKind.EXIT, reason="stopped", code=policy.EXIT_COMPLETED, step=step)
    return policy.EXIT_COMPLETED


def _exclude_recorded_nodes(ctx: RankContext) -> None:
    """Rank 0, right after its own ``scontrol requeue``: keep recorded bad nodes out of the next
    attempt (Slurm accepts an ExcNodeList update only once the job is pending again)."""
    hosts = exclusion.recorded_hosts(ctx.paths.run_dir)
    if hosts and ctx.job_id and ctx.job.cluster.requeue_allowed:
        r = exclusion.set_excluded(ctx.job_id, hosts, exclusion.default_runner)
        ctx.emit(EventKind.EXCLUDE, hosts=hosts, ok=r.ok, detail=r.detail)


def _requeue_away_from_faulty_node(ctx: RankContext, text: str) -> int:
    """A crash that names a hardware fault of this node (ECC, Xid, NVLink, IB) records the node
    and requeues the job without it; any other crash stays a crash (a Python error on a healthy
    rank usually comes from a peer, and must not blame this node)."""
    why = exclusion.hardware_fault(text)
    job_id = ctx.job_id
    if not (why and job_id and ctx.job.cluster.requeue_allowed):
        return EXIT_CRASH
    host = ctx.env.get("SLURMD_NODENAME") or socket.gethostname()
    policy.record_failed_node(ctx.paths.run_dir, host, why, job_id=job_id)
    r = exclusion.requeue_excluding(job_id, exclusion.recorded_hosts(ctx.paths.run_dir))
    ctx.emit(EventKind.EXCLUDE, hosts=[host], ok=r.ok, detail=r.detail, reason=why)
    return policy.EXIT_REQUEUE if r.ok else EXIT_CRASH


if __name__ == "__main__":
    _code = main()
    # The outcome is durable (events fsynced, checkpoint committed, writers closed). Python's shutdown would
    # now garbage-collect every torch/Megatron object in finalize_modules: 7-8 s per rank on a loaded CPU,
    # during which the rank prints nothing and the launcher waits. Objects frozen out of the collector are
    # still released by reference counting; only that last full collection is skipped.
    import gc

    gc.freeze()
    sys.exit(_code)
