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
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


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
    slow_warned: bool = False  # the "still writing after the save deadline" WARNING was given


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
        from functools import partial

        from recovery.signals import deferred

        if delay_s > 0 and request.async_fn is not None:
            request = request._replace(async_fn=partial(delayed_write, delay_s, request.async_fn))
        with deferred():  # the forked writer inherits the mask: Slurm's signal to the step does not cut it
            self.queue.schedule_async_request(request)

    def finalized(self, blocking: bool) -> bool:
        """Every rank (collective): True once every rank's write is done and finalized (metadata written).

        A failed write on any rank raises torch's ``CheckpointException`` on every rank."""
        done = self.queue.maybe_finalize_async_calls(blocking=blocking)
        return bool(done)

    def submit(self, fn: Callable, *args: Any) -> Future:
        assert self.pool is not None, "the commit runs on rank 0"
        return self.pool.submit(fn, *args)

    def close(self) -> None:
        """After the last save: no writer left behind, the commit thread ended."""
        self.queue.close(abort=True)
        if self.pool is not None:
            self.pool.shutdown(wait=True)


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
        import threading

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
