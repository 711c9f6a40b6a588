"""The rank's checkpointing: where to resume from, and when and how to save.

:func:`find_start` (rank 0 decides with :func:`recovery.start.decide_start`, every rank follows) runs
before the model exists; :class:`Checkpointer` owns everything after it: loading the resume point, the
collective save (stage, write shards, commit on rank 0), the steps already durable, the
checkpoint interval (a step count, or ``auto`` resolved from the first measured save) and the
one-time lead-time check. torchtitan's ``CheckpointManager`` is the model: the loop only says
"a step is done" (:meth:`Checkpointer.after_step`) or "save now" (:meth:`Checkpointer.save`).

The commit protocol itself (fsync, manifest, atomic rename, prune) is :mod:`recovery.commit`;
the shard format is Megatron-Core's ``dist_checkpointing`` (:mod:`train.megatron_ckpt`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any, Optional

from launch.kinds import EventKind
from recovery import commit, policy, savefail
from recovery.interval import resolve_interval
from recovery.quarantine import quarantine
from recovery.resume import Resume, find_latest_verified
from recovery.savefail import SaveFailed, save_failed, space_warning
from recovery.signals import deferred
from recovery.start import Start, decide_start
from train.async_ckpt import AsyncSaves, InFlight, save_cost
from train.context import RankContext, broadcast, gather, model_shape

# train.local_ckpt, train.megatron_ckpt and train.train_loop import torch: they are imported where they are used,
# so importing this module (the worker does before torch) stays torch-free.
__all__ = ["Checkpointer", "SaveFailed", "Start", "announce", "configured_interval", "find_start", "vet_resume"]


OUTSIDE_STEPS = 50  # recent steps without a save in flight: the baseline of a save's step-time dip
LOCAL_SETTLE_S = 30.0  # a failed attempt waits this long for its local save in flight (its peers' threads run on)


def find_start(ctx: RankContext) -> Start:
    """Rank 0 takes the run lock, decides from the checkpoints it finds (resume, start, or refuse) and asks
    the requeue policy (:func:`recovery.start.decide_start`); all ranks get the answer. Rank 0 keeps the lock
    (``ctx.run_lock``) for the attempt."""
    from train.local_ckpt import gather_inventories  # torch

    found = gather_inventories(ctx)  # the local tier: each node verifies its sets (collective; None when off)
    start = None
    if ctx.is_first:
        start = _decide(ctx, found[1] if found else None)
    start = broadcast(start)
    start.local_nodes = found[0] if found else None
    return start


def _decide(ctx: RankContext, inventories: Optional[list] = None) -> Start:
    """Rank 0: :func:`recovery.start.decide_start` on this rank's facts; its run lock moves to ``ctx.run_lock``
    (the worker releases it at the attempt's end) and stays off the broadcast."""
    start = decide_start(ctx.paths, ctx.job, restart=ctx.restart, job_id=ctx.job_id, env=ctx.env,
                         storage=ctx.storage, world=ctx.world, layout=ctx.layout, inventories=inventories)
    if start.run_lock is not None:
        ctx.run_lock = start.run_lock
    return replace(start, run_lock=None)


def announce(ctx: RankContext, start: Start) -> None:
    """Every notice of the start decision: a WARNING line (last rank) and an event (rank 0)."""
    for n in start.notices:
        fields = {k: v for k, v in n.items() if k not in ("event", "message")}
        ctx.emit(n["event"], detail=n["message"], **fields)
        ctx.log(f"WARNING: {n['message']}")


def vet_resume(ctx: RankContext, start: Start) -> None:
    """Before the model is built: every fallback as a WARNING and an event (skipped or quarantined checkpoints,
    a missing ``latest`` target, a lock takeover), and refuse a checkpoint written by the other optimizer type
    (its manifest says; the formats cannot be converted)."""
    from train import megatron_ckpt  # torch

    announce(ctx, start)
    resume = start.resume
    if resume.path and "distributed_optimizer" in (resume.meta or {}):
        megatron_ckpt.check_optimizer_type(resume.meta, ctx.job.parallelism.distributed_optimizer, resume.path)


def configured_interval(training: Any) -> Optional[int]:
    """``training.checkpoint_interval`` as the job reads it: steps, or None for 'auto' (resolved after a save)."""
    if training.checkpoint_interval_is_auto:
        return None
    if training.fixed_checkpoint_interval is None:
        raise ValueError(f"training.checkpoint_interval must be a positive int or 'auto', "
                         f"got {training.checkpoint_interval!r}")
    return training.fixed_checkpoint_interval


class Checkpointer:
    """Saves and loads one rank's share of the training state (collective calls: every rank calls them).

    The asynchronous saves (start, poll, wait, rank 0's commit thread, close, abandon) are its field
    ``async_saves`` (:class:`train.async_ckpt.AsyncSaves`), which it hands itself for the steps both kinds of
    save share; :meth:`poll`, :meth:`wait_pending`, :meth:`close`, :meth:`abandon` and ``pending`` are theirs."""

    def __init__(self, ctx: RankContext, parts: Any, identity: Optional[dict] = None) -> None:
        self.ctx = ctx
        self.parts = parts  # train.train_loop.TrainingParts
        self.identity = identity  # the manifest's owner (rank 0)
        self.last_bytes: Optional[int] = None  # size of the newest committed checkpoint: the next one's estimate
        self.interval: Optional[int] = configured_interval(ctx.job.training)  # None: auto, not measured yet
        self.saved_steps: set[int] = set()
        self._lead_checked = False
        self.async_save = bool(getattr(ctx.job.training, "async_save", False))
        self.async_saves = AsyncSaves(ctx, self)  # the save in flight and its writer
        self._step_s = 0.0  # the last step's seconds, as the interval save saw it
        self._owed: Optional[int] = None  # the step an interval save came due while one was in flight
        self._auto_started = False  # 'auto': the measuring save has started
        self._warmup: Optional[Any] = getattr(ctx, "writer_warmup", None)  # joined before the first save
        self._slowest_save_s = 0.0  # start -> durable, the slowest save of this attempt so far
        self.loaded: Optional[tuple] = None  # (path, step) of the checkpoint this attempt loaded last
        self.hold_saves = False  # a replay check is running: periodic saves wait (train/replay_parity.py)
        self.failed_in_a_row = 0  # failed periodic saves since the last committed one (training.on_save_failure)
        self._outside: deque = deque(maxlen=OUTSIDE_STEPS)  # step seconds while no save was in flight
        self._commits = 0  # commits this attempt began (rank 0; the SLURMTRON_TEST_SAVE_EIO hook counts them)
        self.local: Optional[Any] = None  # train.local_ckpt.LocalTier when training.local_checkpoint is on

    # ---- the asynchronous saves (self.async_saves) ----------------------------------------------

    @property
    def pending(self) -> Optional[InFlight]:
        """The one asynchronous save in flight, or None."""
        return self.async_saves.pending

    @pending.setter
    def pending(self, p: Optional[InFlight]) -> None:
        self.async_saves.pending = p

    def _start_async(self, state: Any, reason: str) -> None:
        self.async_saves.start(state, reason)

    def poll(self, blocking: bool = False) -> None:
        """Every rank (collective): :meth:`train.async_ckpt.AsyncSaves.poll`."""
        self.async_saves.poll(blocking)

    def wait_pending(self, why: str) -> float:
        """Every rank: :meth:`train.async_ckpt.AsyncSaves.wait`; the seconds waited."""
        return self.async_saves.wait(why)

    def close(self) -> None:
        """No asynchronous save left in flight or half-agreed; the writer and commit thread ended; the local save in
        flight (if any) committed or said failed."""
        self.async_saves.close()
        if self.local is not None:
            self.local.wait()

    def abandon(self, why: str) -> None:
        """This rank failed: :meth:`train.async_ckpt.AsyncSaves.abandon` (no collective); a local save in flight may
        still commit (its thread's peers run on), for at most ``LOCAL_SETTLE_S``."""
        self.async_saves.abandon(why)
        if self.local is not None:
            self.local.wait(LOCAL_SETTLE_S)

    def _join_warmup(self) -> None:
        """Before the first save: the writer's warm-up (train.async_ckpt.WriterWarmUp) has finished."""
        if self._warmup is None:
            return
        error = self._warmup.join()
        self._warmup = None
        if error:
            msg = f"checkpoint writer not warmed up ({error}); the first save pays its start-up"
            self.ctx.log(f"WARNING: {msg}")
            self.ctx.emit(EventKind.CHECKPOINT_WRITER_COLD, detail=msg)

    # ---- resume ---------------------------------------------------------------------------

    def load(self, resume: Resume) -> Any:
        """Restore model, optimizer and schedule from ``resume`` (any saved layout); the TrainState to go on from."""
        from train import megatron_ckpt
        from train.train_loop import TrainState

        ctx = self.ctx
        if not resume.path:
            return TrainState()
        ctx.beat("load", resume.step or 0)
        ctx.log(f"loading checkpoint from {resume.path} at iteration {resume.step}")
        chunks, optimizer, scheduler = self.parts
        loaded = megatron_ckpt.load(resume.path, chunks, optimizer, scheduler,
                                    distributed_optimizer=self._distributed_optimizer)
        ts = loaded.training_state
        state = TrainState(step=int(ts["step"]), consumed_samples=int(ts["consumed_samples"]),
                           skips=[list(x) for x in ts.get("data_skips") or []])
        ctx.log(f"  successfully loaded checkpoint from {resume.path} at iteration {state.step} "
                f"({loaded.seconds:.2f} s)")
        ctx.emit(EventKind.RESUME, step=state.step, checkpoint=str(resume.path),
                 consumed_samples=state.consumed_samples, from_layout=ts.get("layout"), seconds=loaded.seconds)
        self.saved_steps.add(state.step)
        self.loaded = (resume.path, state.step)
        if ctx.is_first:  # the measured size the next save needs (the free-space check)

            files = commit.manifest_of(resume.path, storage=ctx.storage).get("files") or {}
            self.last_bytes = sum(int(f.get("size") or 0) for f in files.values()) or None
        return state

    def rollback(self, state: Any, bad_from: int) -> Optional[Any]:
        """``training.nan_guard.on_nan=rollback``: reload the newest verified checkpoint in place and skip
        ``training.nan_guard.skip_batches`` global batches from data position ``bad_from``; None if there is none."""
        from train import megatron_ckpt
        from train.train_loop import TrainState

        ctx, t = self.ctx, self.ctx.job.training
        if self.pending is not None:  # its step precedes the non-finite one: let it become the rollback target
            self.wait_pending("nan rollback")
        res = find_latest_verified(ctx.paths.checkpoints, storage=ctx.storage) if ctx.is_first else None
        path = broadcast(res.path if res is not None else None)
        if not path:
            return None
        ctx.beat("load", state.step)
        chunks, optimizer, scheduler = self.parts
        ts = megatron_ckpt.load(path, chunks, optimizer, scheduler,
                                distributed_optimizer=self._distributed_optimizer).training_state
        skips = [list(x) for x in ts.get("data_skips") or []]
        for x in list(state.skips) + [[bad_from, t.nan_guard.skip_batches * t.global_batch_size]]:
            if list(x) not in skips and x[1] > 0:
                skips.append(list(x))
        back = TrainState(step=int(ts["step"]), consumed_samples=int(ts["consumed_samples"]), skips=skips)
        ctx.log(f"WARNING: rolled back to the verified checkpoint {path} (iteration {back.step}); "
                f"{t.nan_guard.skip_batches} batch(es) from sample {bad_from} will be skipped")
        ctx.emit(EventKind.NAN_ROLLBACK, step=state.step + 1, to_step=back.step, checkpoint=str(path),
                 skip_first_sample=bad_from, skip_batches=t.nan_guard.skip_batches)
        if self.local is not None:
            self.local.abandon_after(back.step, f"a NaN rollback to step {back.step} left the steps after it")
        ctx.beat("train", back.step)
        return back

    def replay_rollback(self, state: Any, why: str) -> Optional[Any]:
        """``training.replay.on_mismatch=rollback``: quarantine the checkpoint this attempt loaded (its replay did not
        match the log: moved, never deleted), load the newest verified one left; None if there is none."""
        from train import megatron_ckpt
        from train.train_loop import TrainState

        ctx = self.ctx
        if self.pending is not None:
            self.wait_pending("replay rollback")
        bad_path, bad_step = self.loaded or (None, None)
        path = None
        if ctx.is_first and bad_path is not None:
            moved = quarantine(ctx.paths.checkpoints, bad_path, f"replay mismatch: {why}", storage=ctx.storage)
            ctx.log(f"WARNING: quarantined {bad_path} -> {moved}: its replayed steps do not match the log")
            ctx.emit(EventKind.QUARANTINE, path=str(bad_path), to=str(moved), reason="replay_mismatch",
                     detail=why[:2000])
            res = find_latest_verified(ctx.paths.checkpoints, storage=ctx.storage)
            path = res.path
        path = broadcast(path)
        self.saved_steps.discard(bad_step)
        if not path:
            return None
        ctx.beat("load", state.step)
        chunks, optimizer, scheduler = self.parts
        ts = megatron_ckpt.load(path, chunks, optimizer, scheduler,
                                distributed_optimizer=self._distributed_optimizer).training_state
        back = TrainState(step=int(ts["step"]), consumed_samples=int(ts["consumed_samples"]),
                          skips=[list(x) for x in ts.get("data_skips") or []])
        self.loaded = (path, back.step)
        self.saved_steps.add(back.step)
        ctx.log(f"WARNING: rolled back to the verified checkpoint {path} (iteration {back.step}) after a replay "
                f"mismatch; replaying from there")
        ctx.emit(EventKind.REPLAY_ROLLBACK, step=state.step, to_step=back.step, checkpoint=str(path),
                 from_step=bad_step)
        if self.local is not None:
            self.local.abandon_after(back.step, f"a replay rollback to step {back.step} left the steps after it")
        ctx.beat("train", back.step)
        return back

    # ---- save -----------------------------------------------------------------------------

    def after_step(self, state: Any, step_s: float, iters: int) -> None:
        """A step is done: the global tier (:meth:`_after_step_global`), then a node-local save when one is due
        (never where a global save is, nor while the replay check holds saves)."""
        self._after_step_global(state, step_s, iters)
        if self.local is None:
            return
        self.local.poll()
        if not self.hold_saves and self.local.due(state.step, iters, self.interval, self.saved_steps):
            self.local.save(state)

    def _after_step_global(self, state: Any, step_s: float, iters: int) -> None:
        """Finish an async save whose write ended, then save at the interval (the first step resolves ``auto``);
        never after the last step (the final save is save_final's)."""
        step = self.pending.step if self.pending is not None else state.step
        (self.pending.step_times if self.pending is not None else self._outside).append(step_s)
        try:
            self.poll()
        except SaveFailed as e:  # an asynchronous periodic save failed: the policy decides
            self.judge_failure(e, step, "interval")
        if state.step >= iters:
            return
        if self.interval is None:
            if not self._auto_started and not self.hold_saves:  # the measuring save (async: resolved when it commits)
                self._auto_started = True
                self._periodic(state, step_s)
            return
        if state.step % self.interval == 0 or self._owed is not None:
            if self.hold_saves:  # a state the replay check has not vouched for yet is not saved: it comes due later
                self._owed = state.step if self._owed is None else self._owed
                return
            self._periodic(state, step_s)

    def _periodic(self, state: Any, step_s: float) -> None:
        """An interval save (asynchronous if configured, at most one in flight, else synchronous); a failure
        follows ``training.on_save_failure`` (:meth:`judge_failure`)."""
        try:
            self._periodic_save(state, step_s)
        except SaveFailed as e:
            self.judge_failure(e, state.step, "interval")

    def judge_failure(self, e: "SaveFailed", step: int, save_reason: str) -> None:
        """Every rank, after a save failed (its staging directory was removed, committed checkpoints untouched):
        a ``save_failed`` event with the cause; raise ``e`` (the attempt stops with its reason) unless the policy
        goes on (:func:`recovery.savefail.judge_failure`), then a WARNING."""

        t, ctx = self.ctx.job.training, self.ctx
        self.failed_in_a_row += 1
        go_on, why = savefail.judge_failure(t.on_save_failure, save_reason, self.failed_in_a_row, t.max_skipped_saves)
        stop = e.stop
        ctx.emit(EventKind.SAVE_FAILED, step=stop.get("step", step), cause=stop.get("cause", stop["reason"]),
                 save=save_reason, policy=t.on_save_failure, in_a_row=self.failed_in_a_row, go_on=go_on,
                 detail=f"{stop['detail']}; {why}"[:2000])
        e.reported = True
        if not go_on:
            raise e
        ctx.log(f"WARNING: the checkpoint of iteration {step} failed ({stop['reason']}: {stop['detail']}); {why}")

    def _periodic_save(self, state: Any, step_s: float) -> None:

        self._step_s = step_s
        if not self.async_save:
            self._owed = None
            save_s = self.save(state, "interval")
            if self.interval is None:
                self.interval = self._resolve_auto(step_s, save_s)
            if save_s > 0 and not self._lead_checked:  # the first measured save: is the lead time enough?
                self._check_lead(step_s, save_s)
                self._lead_checked = True
            return
        if self.pending is not None:
            if self._owed is None:  # said once per delayed save
                self._owed = state.step
                msg = (f"checkpoint at iteration {state.step} delayed: the asynchronous save of iteration "
                       f"{self.pending.step} is still being written (at most one save in flight); it is saved "
                       f"at the first step boundary after that one is committed")
                self.ctx.log(f"WARNING: {msg}")
                self.ctx.emit(EventKind.CHECKPOINT_DELAYED, step=state.step, pending_step=self.pending.step, detail=msg)
            return
        self._owed = None
        if state.step == 0 or state.step in self.saved_steps:
            return
        with deferred():
            self._start_async(state, "interval")

    def save_final(self, state: Any) -> None:
        """At the end of training: make the last step durable unless it already is."""
        if state.step not in self.saved_steps:
            self.save(state, "final")
        self.close()

    def save(self, state: Any, reason: str) -> float:
        """Every rank: a checkpoint of ``state`` (reason: interval | signal | final); its seconds (0: none needed).

        An asynchronous save still in flight is finished (written, committed, agreed) first; the step is
        then saved synchronously unless it is the one that save just made durable."""

        if self.pending is not None:
            self.wait_pending(reason)
        if state.step == 0 or state.step in self.saved_steps:
            # Nothing new to make durable: a step-0 checkpoint holds no optimizer state (Adam's
            # is created by the first step) and would break the next attempt's load; a step
            # already committed needs no second copy. A stop here requeues without saving, and
            # the zero-progress guard counts it as a restart that made no progress.
            self.ctx.log(f"no checkpoint needed at iteration {state.step} ({reason}): "
                         f"{'nothing trained yet' if state.step == 0 else 'already saved'}")
            return 0.0
        with deferred():  # a stop signal during the save is delivered after it (recovery/signals.py)
            return self._save(state, reason)

    def _save(self, state: Any, reason: str) -> float:
        """Stage (rank 0), write and seal shards (all; rank 0 gathers the digests), commit (rank 0)."""
        from torch.distributed.checkpoint.api import CheckpointException  # derives from BaseException, not Exception

        from train import megatron_ckpt

        ctx, step = self.ctx, state.step
        t0 = ctx.clock()
        ctx.beat("save", step)
        self._join_warmup()
        final = ctx.paths.checkpoint(step)
        ctx.log(f"saving checkpoint at iteration {step:7d} to {final}")
        stop = None
        if ctx.is_first:
            stop = self._stage(step)
        self._agree(stop)  # every rank learns a refused save (no room, no access) before writing a byte
        meta = self._meta(state)
        chunks, optimizer, scheduler = self.parts
        sd = megatron_ckpt.sharded_state(chunks, optimizer, scheduler, meta,
                                         distributed_optimizer=self._distributed_optimizer, is_loading=False)
        try:
            megatron_ckpt.save_shards(ctx.paths.staging(step), sd, distributed_optimizer=self._distributed_optimizer)
        except (Exception, CheckpointException) as e:  # a write failure reaches every rank (gathered by Megatron)
            self._agree(self._failed(e, step) if ctx.is_first else None, e)
            raise
        sealed = gather(self._seal_own(step))  # rank 0 learns that every rank's write is done, and its digests
        if ctx.hooks.hangs_in("save", ctx.rank, ctx.restart, step):
            ctx.sleep(ctx.hooks.hang_s)
        if ctx.is_first:
            if ctx.hooks.save_sleep_s > 0:
                ctx.sleep(ctx.hooks.save_sleep_s)
            try:
                self._commits += 1
                ctx.hooks.fail_commit(self._commits, ctx.paths.staging(step))
                result = commit.commit(ctx.paths.checkpoints, step, meta, keep=ctx.job.training.keep_checkpoints,
                                       storage=ctx.storage, run=self.identity, digests=self._digests(sealed, step))
            except Exception as e:
                stop = self._failed(e, step)
                if stop is None:
                    raise
            else:
                self._committed(result, step, reason, t0)
        self._agree(stop)
        self.saved_steps.add(step)
        self.failed_in_a_row = 0
        seconds = ctx.clock() - t0
        self._slowest_save_s = max(self._slowest_save_s, seconds)
        ctx.beat("saved", step, seconds)
        ctx.log(f"  successfully saved checkpoint at iteration {step:7d} to {final} ({seconds:.2f} s)")
        self._said_cost(step, "sync", save_cost(seconds, seconds, [], list(self._outside)))
        return seconds

    def _said_cost(self, step: int, mode: str, cost: dict) -> None:
        """The three numbers of a committed save as a ``checkpoint_cost`` event and TensorBoard scalars."""
        self.ctx.emit(EventKind.CHECKPOINT_COST, step=step, mode=mode, **cost)
        if self.ctx.tracker is not None:
            self.ctx.tracker.scalars(step, {k: v for k, v in (
                ("ckpt_blocked_s", cost["blocked_s"]), ("ckpt_durable_s", cost["durable_s"]),
                ("ckpt_step_dip", cost["dip"])) if v is not None})

    def _seal_own(self, step: int) -> tuple:
        """Every rank, after its shards are written: fsync and hash them here, while they are in this node's page
        cache, so rank 0 does not re-read the whole checkpoint (``recovery.commit.commit(digests=...)``).
        ("ok", {file: (size, digest)}) or ("error", why): rank 0 then hashes those files itself."""
        from train.megatron_ckpt import own_shard_files

        staging = self.ctx.paths.staging(step)
        try:
            return "ok", commit.seal_files(staging, own_shard_files(staging, self.ctx.rank), storage=self.ctx.storage)
        except Exception as e:  # noqa: BLE001 - rank 0 reads the files instead, and says so
            return "error", f"{type(e).__name__}: {e}"

    def _digests(self, sealed: list, step: int) -> dict:
        """Rank 0: the digests every rank sealed; a rank that could not seal its files is said (WARNING +
        ``checkpoint_seal_fallback``) and its files are hashed by the commit instead."""
        digests: dict = {}
        for rank, (kind, value) in enumerate(sealed):
            if kind == "ok":
                digests.update(value)
                continue
            msg = (f"rank {rank} could not hash its shards of iteration {step} ({value}); rank 0 reads and hashes "
                   f"them instead")
            self.ctx.log(f"WARNING: {msg}")
            self.ctx.emit(EventKind.CHECKPOINT_SEAL_FALLBACK, step=step, rank=rank, detail=msg)
        return digests

    def _stage(self, step: int) -> Optional[dict]:
        """Rank 0: an empty staging directory, and the free-space check against the expected size."""

        ctx = self.ctx
        try:
            commit.prepare_staging(ctx.paths.checkpoints, step, storage=ctx.storage)
        except Exception as e:
            stop = save_failed(e, ctx.paths.checkpoints, step, storage=ctx.storage)
            if stop is None:
                raise
            return stop
        expected = self.last_bytes or self._planned_bytes()
        warn = space_warning(ctx.paths.checkpoints, expected, storage=ctx.storage)
        if warn is None:
            return None
        text, fields = warn
        if self.last_bytes and fields["free_bytes"] < self.last_bytes:  # a measured size that cannot fit: stop now
            commit.abort_save(ctx.paths.checkpoints, step, storage=ctx.storage)
            detail = (f"disk full before saving step {step}: {fields['free_bytes']} bytes free at {fields['path']}, "
                      f"the last checkpoint took {self.last_bytes}; nothing was written, committed checkpoints are "
                      f"untouched. Free space, then resubmit the same run.name")
            return {"reason": "disk_full", "code": policy.EXIT_DISK_FULL, "detail": detail, "step": step, **fields}
        ctx.emit(EventKind.DISK_SPACE_WARNING, detail=text, step=step, **fields)
        ctx.log(f"WARNING: {text}")
        return None

    def _failed(self, exc: BaseException, step: int) -> Optional[dict]:

        return save_failed(exc, self.ctx.paths.checkpoints, step, storage=self.ctx.storage,
                           expected_bytes=self.last_bytes or self._planned_bytes())

    def _agree(self, stop: Optional[dict], exc: Optional[BaseException] = None) -> None:
        """Rank 0's verdict on the save to every rank; a refused save raises :class:`SaveFailed` everywhere."""
        stop = broadcast(stop)
        if stop is not None:
            raise SaveFailed(stop) from exc

    def _committed(self, result: Any, step: int, reason: str, t0: float, record: Optional[dict] = None) -> None:
        """Rank 0, after a commit: the ``checkpoint_saved`` event (``record``: already written by the async commit
        thread; then only the tracker gets it here), quarantines and a skipped prune as WARNINGs and events."""
        ctx = self.ctx
        self.last_bytes = result.bytes
        if record is None:
            ctx.emit(EventKind.CHECKPOINT_SAVED, step=step, path=str(result.path), seconds=ctx.clock() - t0,
                     bytes=result.bytes, reason=reason)
        elif ctx.tracker is not None:
            ctx.tracker.event(record)
        for original, dest, why in result.quarantined:
            ctx.emit(EventKind.QUARANTINE, path=str(original), to=str(dest), reason=why, detail=f"quarantined: {why}")
            ctx.log(f"WARNING: quarantined {original} -> {dest}: {why}")
        if result.prune_error:
            ctx.emit(EventKind.PRUNE_SKIPPED, detail=result.prune_error, step=step)
            ctx.log(f"WARNING: old checkpoints not pruned: {result.prune_error}")

    def _planned_bytes(self) -> Optional[float]:
        """The size to expect before the first save measures one: this rank's parameters times the ranks that
        hold distinct shards (world / dp), at weights + fp32 main weights + two Adam moments per parameter (the
        planner's accounting in ``launch.planner.estimate.checkpoint_bytes``, which the ranks do not import)."""
        job = self.ctx.job
        chunks = self.parts[0]
        local = sum(p.numel() for chunk in chunks for p in chunk.parameters())
        shards = max(1, job.world_size // max(1, job.dp))
        per_param = 12 if job.training.precision == "fp32" else 14
        return float(local * shards * per_param)

    def _meta(self, state: Any) -> dict:
        """The manifest's summary: enough for a resume to refuse an incompatible checkpoint unopened."""
        job = self.ctx.job
        return {
            "step": state.step, "consumed_samples": state.consumed_samples, "layout": self.ctx.layout,
            "distributed_optimizer": self._distributed_optimizer, "restart_count": self.ctx.restart,
            "model": model_shape(job), "seed": job.training.seed, "data_skips": [list(x) for x in state.skips],
        }

    # ---- interval and lead time -------------------------------------------------------------

    def _resolve_auto(self, step_s: float, save_s: float, write_s: Optional[float] = None) -> int:
        """Young/Daly from the measured save: ``save_s`` is what a save stalls training (the overhead term);
        ``write_s`` (async) how long until it is durable (the exposure term), by default the same."""
        job = self.ctx.job
        steps, why = resolve_interval(job.training.checkpoint_interval, save_s=save_s, step_s=step_s,
                                      node_mtbf_hours=job.cluster.node_mtbf_hours, nodes=job.cluster.nodes,
                                      write_s=write_s)
        self.ctx.emit(EventKind.CHECKPOINT_INTERVAL, interval=steps, reasoning=why, blocking_s=save_s,
                      write_s=save_s if write_s is None else write_s)
        self.ctx.log(f"checkpoint interval: {why}")
        return steps

    def _check_lead(self, step_s: float, save_s: float, wait_s: float = 0.0) -> None:
        """Does the signal lead time fit the rest of a step, the wait for an async save in flight (``wait_s``,
        its whole write in the worst case) and the synchronous stop save?"""

        lead = self.ctx.job.training.signal_lead_time_s
        warn = policy.lead_time_warning(lead, step_s, save_s, wait_s=wait_s)
        if warn:
            self.ctx.log(f"WARNING: {warn}")
            self.ctx.emit(EventKind.LEAD_TIME_WARNING, lead_s=lead, step_s=step_s, save_s=save_s, wait_s=wait_s,
                          detail=warn)

    @property
    def _distributed_optimizer(self) -> bool:
        return bool(self.ctx.job.parallelism.distributed_optimizer)
