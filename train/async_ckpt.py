"""Asynchronous checkpoint writes through Megatron-Core's own async path (``training.async_save=true``).

What Megatron-Core 0.16 does (``megatron/core/dist_checkpointing``; nvidia-resiliency-ext is
not involved: core 0.16 ships its own ``strategies/async_utils.py``, and only its *local*
checkpointing imports the resiliency package):

* ``dist_checkpointing.save(..., async_sharded_save=True)`` plans the save on every rank
  (collective), writes ``common.pt`` on rank 0, and returns an ``AsyncRequest`` whose
  ``async_fn`` is ``FileSystemWriterAsync.write_preloaded_data_multiproc``: it writes this
  rank's shards with ``thread_count`` (2) forked writer processes, each ``fsync``-ing its file.
  Its ``finalize_fns`` gather the write results, write ``.metadata`` (rank 0) and
  ``metadata.json``, with a barrier: collective, run on every rank after every rank's write.
  The synchronous ``save`` is the same request run in place (``AsyncRequest.execute_sync``).
* ``AsyncCallsQueue(persistent=False)`` runs ``async_fn`` in a *forked* process
  (``TemporalAsyncCaller``) and ``maybe_finalize_async_calls`` all-reduces "still writing?"
  over the ranks, then runs the finalize functions. On CPU the fork *is* the snapshot: the
  shards are the live parameter and optimizer tensors (``preload_tensors`` copies only device
  tensors), and copy-on-write keeps the child's view at the step it forked while training
  goes on. The persistent caller (``persistent=True``) is not used: it hands the request to
  a spawned process through a queue, which on CPU shares the live tensors instead of copying
  them, so a write could see a later step's values.

The commit (checksums, manifest, atomic rename, ``latest``: :mod:`recovery.commit`) runs on
rank 0 only after the finalize succeeded on all ranks, in a thread (hashing releases the
GIL), and the ranks agree on its outcome at a later step boundary before the step counts as
saved. A kill during the write or the commit leaves an ``iter_N.tmp`` that is never loaded.

:class:`AsyncSaves` is that half of :class:`train.checkpointer.Checkpointer` (start, poll, wait,
the commit thread, close, abandon), a field of it (``ckpt.async_saves``) that is handed the checkpointer for
the steps both kinds of save share; :class:`AsyncWriter` wraps the queue and the commit thread.
"""
from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Optional

from launch.kinds import EventKind
from recovery import commit, policy
from recovery.savefail import SaveFailed
from recovery.signals import deferred
from train.context import RankContext, broadcast

# train.megatron_ckpt (torch, Megatron-Core) is imported where it is used: importing this module stays torch-free.
if TYPE_CHECKING:  # the owner; at run time it imports this module, not the other way round
    from train.checkpointer import Checkpointer


WAIT_POLL_S = 0.05  # between the collective polls of a wait for the save in flight


@dataclass
class InFlight:
    """One asynchronous save between its start and its agreed commit (every rank holds one)."""

    step: int
    reason: str
    t0: float  # clock() at the start of the save
    blocking_s: float  # what the save cost the training loop: stage, plan, common.pt, fork
    meta: dict  # the manifest's summary
    phase: str = "write"  # write (the forked writers) | commit (rank 0's thread)
    written_s: float = 0.0  # t0 -> every rank's shards finalized
    commit: Optional[Future] = None  # rank 0: the commit thread's result
    step_times: list = field(default_factory=list)  # seconds of the steps trained while this save was in flight


def save_cost(blocked_s: float, durable_s: float, during: list, outside: list) -> dict:
    """The three numbers of one save: training blocked, time until durable, and the step-time dip while the writer
    ran (median step time during the write over the median outside it, minus 1; None without steps on both sides:
    a synchronous save trains no step during its write)."""
    med_in = statistics.median(during) if during else None
    med_out = statistics.median(outside) if outside else None
    dip = (med_in / med_out - 1.0) if med_in is not None and med_out else None
    return {"blocked_s": blocked_s, "durable_s": durable_s, "step_s_during": med_in, "step_s_outside": med_out,
            "steps_during": len(during), "dip": dip}


def cost_words(c: dict) -> str:
    """The three numbers in words, for the log line."""
    dip = ("no step trained during the write" if c["dip"] is None else
           f"step time during the write {c['step_s_during'] * 1000:.1f} ms vs {c['step_s_outside'] * 1000:.1f} ms "
           f"outside ({c['dip'] * 100:+.1f}%, {c['steps_during']} step(s))")
    return f"training blocked {c['blocked_s']:.2f} s, durable {c['durable_s']:.2f} s after the start, {dip}"


def delayed_write(delay_s: float, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``SLURMTRON_TEST_ASYNC_WRITE_SLEEP_S``: the forked writer sleeps before writing (a wide window)."""
    time.sleep(delay_s)
    return fn(*args, **kwargs)


class AsyncWriter:
    """Megatron-Core's ``AsyncCallsQueue`` with at most one request, and rank 0's commit thread."""

    def __init__(self, is_first: bool) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue(persistent=False)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit") if is_first else None

    def schedule(self, request: Any, delay_s: float = 0.0) -> None:
        """Every rank: fork the writer of this rank's shards (stop signals stay blocked in it)."""
        from train.megatron_ckpt import no_zip_crc32  # torch

        if delay_s > 0 and request.async_fn is not None:
            request = request._replace(async_fn=partial(delayed_write, delay_s, request.async_fn))
        # the forked writer inherits the mask (Slurm's signal to the step does not cut it) and torch.save's
        # CRC32 setting (megatron_ckpt.no_zip_crc32: the manifest's SHA-256 is the check)
        with deferred(), no_zip_crc32():
            self.queue.schedule_async_request(request)

    def finalized(self, blocking: bool) -> bool:
        """Every rank (collective): True once every rank's write is done and finalized (metadata written).

        A failed write on any rank raises torch's ``CheckpointException`` on every rank."""
        done = self.queue.maybe_finalize_async_calls(blocking=blocking)
        return bool(done)

    def agree(self, mine: bool) -> bool:
        """Every rank (collective): rank 0's verdict (its clock decides a deadline), the same on every rank."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([int(mine)], dtype=torch.int64)
        dist.broadcast(t, src=0)
        return bool(t.item())

    def abandon(self) -> None:
        """Every rank, agreed: give up the write in flight. Its forked writer (and the writer processes it forked)
        is killed; the request leaves the queue, so the next save's index is the same on every rank."""
        import psutil

        while self.queue.async_calls:
            call = self.queue.async_calls.popleft()
            proc = getattr(call.async_caller, "process", None)
            if proc is not None and proc.pid is not None:
                try:
                    for child in psutil.Process(proc.pid).children(recursive=True):
                        child.kill()
                except psutil.Error:
                    pass
            call.async_caller.close(abort=True)

    def submit(self, fn: Callable, *args: Any) -> Future:
        assert self.pool is not None, "the commit runs on rank 0"
        return self.pool.submit(fn, *args)

    def close(self) -> None:
        """After the last save: no writer left behind, the commit thread ended."""
        self.queue.close(abort=True)
        if self.pool is not None:
            self.pool.shutdown(wait=True)


class AsyncSaves:
    """The asynchronous half of a :class:`train.checkpointer.Checkpointer` (start, poll, wait, rank 0's commit
    thread, close, abandon), held by it as ``ckpt.async_saves``. It owns the save in flight (``pending``) and
    the writer; the checkpointer it is given owns what synchronous and asynchronous saves share (the steps
    saved, the interval, the lead-time check, staging, the rank agreement and the commit's events). Every method
    but the commit thread's is called by every rank at a step boundary; :meth:`poll` is collective."""

    def __init__(self, ctx: RankContext, ckpt: Checkpointer) -> None:
        self.ctx = ctx
        self.ckpt = ckpt  # the owner: its shared steps (_stage, _agree, _failed, _committed, _meta, ...)
        self.pending: Optional[InFlight] = None  # the one asynchronous save in flight
        self.writer: Optional[AsyncWriter] = None  # made at the first asynchronous save

    def start(self, state: Any, reason: str) -> None:
        """Every rank: stage (rank 0), plan and fork this rank's shard writer; training goes on meanwhile."""
        from torch.distributed.checkpoint.api import CheckpointException

        from train import megatron_ckpt

        ctx, ck, step = self.ctx, self.ckpt, state.step
        t0 = ctx.clock()
        ctx.beat("save", step)
        ck._join_warmup()
        ctx.log(f"saving checkpoint at iteration {step:7d} to {ctx.paths.checkpoint(step)} (asynchronous)")
        stop = ck._stage(step) if ctx.is_first else None
        ck._agree(stop)
        meta = ck._meta(state)
        chunks, optimizer, scheduler = ck.parts
        sd = megatron_ckpt.sharded_state(chunks, optimizer, scheduler, meta,
                                         distributed_optimizer=ck._distributed_optimizer, is_loading=False)
        if self.writer is None:
            self.writer = AsyncWriter(ctx.is_first)
        try:
            request = megatron_ckpt.start_shards_async(ctx.paths.staging(step), sd,
                                                       distributed_optimizer=ck._distributed_optimizer)
            self.writer.schedule(request, ctx.hooks.write_delay(step))
        except (Exception, CheckpointException) as e:
            ck._agree(ck._failed(e, step) if ctx.is_first else None, e)
            raise
        blocking = ctx.clock() - t0
        self.pending = InFlight(step, reason, t0, blocking, meta)
        ctx.beat("train", step)  # the write goes on in the background: the watchdog watches steps again
        ctx.emit(EventKind.CHECKPOINT_ASYNC_STARTED, step=step, blocking_s=blocking, reason=reason)
        ctx.log(f"  checkpoint at iteration {step:7d} is being written in the background "
                f"(training blocked {blocking:.2f} s)")

    def poll(self, blocking: bool = False) -> None:
        """Every rank, at a step boundary (collective): move the save in flight on when its write ended on
        every rank (finalize, then rank 0 commits in a thread) and when the commit is done (agree on it)."""
        from torch.distributed.checkpoint.api import CheckpointException

        p, ctx, ck = self.pending, self.ctx, self.ckpt
        if p is None:
            return
        if p.phase == "write":
            try:
                done = self.writer.finalized(blocking)
            except (Exception, CheckpointException) as e:  # a failed write on any rank reaches every rank
                self.pending = None
                ck._agree(ck._failed(e, p.step) if ctx.is_first else None, e)
                raise
            if not done:
                self._abandon_if_stuck(p)
                return
            p.written_s = ctx.clock() - p.t0
            p.phase = "commit"
            if ctx.is_first:
                p.commit = self.writer.submit(self._commit, p)
        kind, value, shared = "", None, None
        if ctx.is_first:
            kind, value = p.commit.result() if (blocking or p.commit.done()) else ("running", None)
            shared = ("failed", None) if kind == "error" else (
                kind, value if kind == "failed" else value[1]["seconds"] if kind == "ok" else None)
        shared = broadcast(shared)  # ("running" | "ok" | "failed", the stop on a refused commit | seconds to durable)
        if shared[0] == "running":
            return
        self.pending = None
        if kind == "error":  # rank 0's own crash (not a storage error): raised as it is
            raise value
        if shared[0] == "failed":
            if shared[1] is None:
                raise RuntimeError(f"rank 0 failed committing the checkpoint of iteration {p.step}")
            raise SaveFailed(shared[1])
        self._committed(p, value, shared[1])

    def wait(self, why: str) -> float:
        """Every rank: block until the save in flight is written, committed and agreed; the seconds waited."""
        p, ctx = self.pending, self.ctx
        t0 = ctx.clock()
        ctx.beat("save", p.step)
        ctx.log(f"waiting for the asynchronous save of iteration {p.step} ({why})")
        with deferred():
            try:
                while self.pending is not None:  # non-blocking polls: a stuck writer is abandoned at its deadline
                    self.poll()
                    if self.pending is not None:
                        ctx.sleep(WAIT_POLL_S)
            except SaveFailed as e:  # the periodic save in flight failed: its policy, then the caller's own save
                self.ckpt.judge_failure(e, p.step, p.reason)
                return ctx.clock() - t0
        waited = ctx.clock() - t0
        ctx.emit(EventKind.CHECKPOINT_WAIT, step=p.step, seconds=waited, reason=why)
        ctx.log(f"  the asynchronous save of iteration {p.step} is durable (waited {waited:.2f} s)")
        return waited

    def _committed(self, p: InFlight, result: Any, durable_s: Optional[float] = None) -> None:
        """Every rank: the agreed end of an asynchronous save (rank 0 holds the commit's result; ``durable_s``: its
        start -> commit done, as rank 0's commit thread measured it; the agreement comes up to a step later)."""
        ctx, ck = self.ctx, self.ckpt
        total = ctx.clock() - p.t0
        if ctx.is_first:
            result, record = result
            ck._committed(result, p.step, p.reason, p.t0, record=record)
        ck.saved_steps.add(p.step)
        ck.failed_in_a_row = 0
        ck._slowest_save_s = max(ck._slowest_save_s, total)
        ctx.beat("saved", p.step, total)
        cost = save_cost(p.blocking_s, total if durable_s is None else durable_s, p.step_times, list(ck._outside))
        ctx.log(f"  successfully saved checkpoint at iteration {p.step:7d} to {ctx.paths.checkpoint(p.step)} "
                f"(asynchronous: written {p.written_s:.2f} s after the start; {cost_words(cost)})")
        ck._said_cost(p.step, "async", cost)
        step_s = ck._step_s
        if ck.interval is None and step_s > 0:
            ck.interval = ck._resolve_auto(step_s, p.blocking_s, total)
        if not ck._lead_checked and step_s > 0:
            ck._check_lead(step_s, total, wait_s=total)
            ck._lead_checked = True

    def _abandon_if_stuck(self, p: InFlight) -> None:
        """A write not durable within the save deadline the hang watchdog applies to a blocking save
        (max(training.watchdog.save_factor x the slowest save so far, training.watchdog.save_floor_s)) is abandoned on every
        rank (rank 0's clock decides; collective): its writers are killed, its staging directory ``iter_N.tmp`` is
        never loaded (the next commit's prune removes it), a WARNING and ``checkpoint_abandoned`` (cause
        ``writer_stuck``) say so, and :class:`recovery.savefail.SaveFailed` hands it to ``training.on_save_failure``.
        Training never waits behind a stuck writer."""
        w, ctx, slowest = self.ctx.job.training.watchdog, self.ctx, self.ckpt._slowest_save_s
        limit = max(w.save_factor * slowest, w.save_floor_s)
        age = ctx.clock() - p.t0
        if not self.writer.agree(ctx.is_first and age > limit):
            return
        self.writer.abandon()
        self.pending = None
        msg = (f"the asynchronous save of iteration {p.step} is not durable after {age:.0f} s > max("
               f"training.watchdog.save_factor {w.save_factor:g} x slowest save {slowest:.1f} s, "
               f"training.watchdog.save_floor_s {w.save_floor_s:g}) = {limit:.0f} s: its writer is stuck (or the "
               f"filesystem too slow); abandoned: its writers were killed, {ctx.paths.staging(p.step).name} is never "
               f"loaded")
        ctx.log(f"WARNING: {msg}")
        ctx.emit(EventKind.CHECKPOINT_ABANDONED, step=p.step, phase=p.phase, cause="writer_stuck", seconds=age,
                 limit_s=limit, detail=msg)
        raise SaveFailed({"reason": "storage_error", "cause": "writer_stuck", "code": policy.EXIT_STORAGE,
                          "detail": msg, "step": p.step})

    def _commit(self, p: InFlight) -> tuple:
        """Rank 0's commit thread: every rank's shards are written and finalized; make them durable."""
        ctx, ck = self.ctx, self.ckpt
        try:
            if ctx.hooks.save_sleep_s > 0:
                ctx.sleep(ctx.hooks.save_sleep_s)
            ck._commits += 1
            ctx.hooks.fail_commit(ck._commits, ctx.paths.staging(p.step))
            result = commit.commit(ctx.paths.checkpoints, p.step, p.meta, keep=ctx.job.training.keep_checkpoints,
                                   storage=ctx.storage, run=ck.identity)
            # durable now: recorded at once (the event log appends one line per write), not at the agreement a
            # step later, so the log never lacks a committed checkpoint that a kill in between leaves behind
            record = ctx.events.emit(EventKind.CHECKPOINT_SAVED, step=p.step, path=str(result.path),
                                     seconds=ctx.clock() - p.t0, bytes=result.bytes, reason=p.reason,
                                     blocking_s=p.blocking_s, written_s=p.written_s, mode="async")
            return ("ok", (result, record))
        except Exception as e:
            stop = ck._failed(e, p.step)
            return ("failed", stop) if stop is not None else ("error", e)

    def close(self) -> None:
        """No asynchronous save left in flight or half-agreed; the writer and commit thread ended."""
        if self.pending is not None:
            self.wait("shutdown")
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def abandon(self, why: str) -> None:
        """This rank failed with an asynchronous save in flight (no collective is safe now).

        A write not yet finalized on every rank cannot be finished without them: it stays ``iter_N.tmp``, is never
        loaded, and is said (WARNING + ``checkpoint_abandoned``) so the step the next attempt resumes from is no
        surprise. A commit already running on rank 0 (every rank's shards were finalized) is let finish: it needs
        no other rank, and its checkpoint is then verified and durable."""
        p, ctx = self.pending, self.ctx
        if p is None:
            return
        self.pending = None
        if p.phase == "commit" and p.commit is not None:
            kind, _ = p.commit.result()
            if kind == "ok":
                ctx.log(f"the asynchronous save of iteration {p.step} was committing when this rank failed ({why}); "
                        f"it is durable and verified")
                return
        msg = (f"the asynchronous save of iteration {p.step} was in flight ({p.phase}) when this rank failed ({why}); "
               f"it cannot be finished without every rank, so it stays {ctx.paths.staging(p.step).name} and is never "
               f"loaded: the next attempt resumes from the newest verified checkpoint before iteration {p.step}")
        ctx.log(f"WARNING: {msg}")
        ctx.emit(EventKind.CHECKPOINT_ABANDONED, step=p.step, phase=p.phase, detail=msg)


def warm_results_queue() -> None:
    """Make dist_checkpointing's write-results manager import what it will unpickle, before the first save.

    The cold writer: Megatron-Core's ``filesystem_async._get_write_results_queue`` is a queue held by a
    ``multiprocessing`` Manager, a freshly *spawned* interpreter that has imported nothing but
    ``multiprocessing`` (started at worker start, :func:`train.distributed.start_checkpoint_helpers`). Every
    save ends with ``results_queue.put({proc: [WriteResult(MetadataIndex, size, _StorageInfo)]})``; the
    manager unpickles that, so the *first* put makes it import ``torch`` and ``torch.distributed.checkpoint``
    (~1.5 s of a ~1.9 s first save on the CPU machine, measured with cProfile: ``managers._callmethod`` under
    ``write_preloaded_data_multiproc``); later saves do not pay it. One round trip of the same types at start-up
    pays it off the critical path. Call before any save runs (the queue is shared with the saves).
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    queue = filesystem_async._get_write_results_queue()
    queue.put({0: [WriteResult(index=MetadataIndex("warm-up"), size_in_bytes=0,
                               storage_data=_StorageInfo("warm-up", 0, 0))]})
    queue.get()


class WriterWarmUp:
    """:func:`warm_results_queue` in a background thread, started at worker start; ``join`` before the first
    save. ``error``: why it failed (the first save then pays the cold writer; the checkpointer says so)."""

    def __init__(self) -> None:
        self.error: Optional[str] = None
        self.thread = threading.Thread(target=self._run, name="ckpt-writer-warm-up", daemon=True)

    def _run(self) -> None:
        try:
            warm_results_queue()
        except Exception as e:  # noqa: BLE001 - reported by the checkpointer before the first save
            self.error = f"{type(e).__name__}: {e}"

    def start(self) -> "WriterWarmUp":
        self.thread.start()
        return self

    def join(self) -> Optional[str]:
        self.thread.join()
        return self.error
