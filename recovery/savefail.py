"""A save that cannot be written: free space before it, and what to do when the filesystem refuses it.

Before a save, rank 0 compares the free space of the checkpoint filesystem with the expected
checkpoint size (the newest committed checkpoint's size, or the planner's estimate before the
first save) and warns while there is still room: below two checkpoints' worth, the *next* save
will likely fail. It does not refuse: the space may be freed in time, and the save itself is
the real test.

When a save fails with a storage error (:func:`recovery.storage.classify`), every rank learns it
(the worker all-reduces the failure kind), rank 0 removes the staging directory
(:func:`recovery.commit.abort_save`: the torn shards would otherwise keep the disk full),
every committed checkpoint stays, and the attempt stops with a named reason:

* ``disk_full`` (ENOSPC, EDQUOT), exit :data:`recovery.policy.EXIT_DISK_FULL`;
* ``storage_error`` (EACCES, EIO, ESTALE, ...), exit :data:`recovery.policy.EXIT_STORAGE`.

A failed *periodic* save follows ``training.on_save_failure`` (:func:`judge_failure`): ``stop`` (the
default, as above), ``retry`` (save again at the next interval; a second failure in a row stops) or ``skip``
(a WARNING, up to ``training.max_skipped_saves`` in a row). Each failure is a ``save_failed`` event with its
cause; a stop or final save always stops.

Requeue policy: neither is requeued. Space does not come back by itself on a shared
filesystem (a quota stays full until a person acts), and a requeued attempt would resume from
the last checkpoint, train, and hit the same wall, burning an allocation each time until the
zero-progress guard stops it. The ``stop`` event names the path and the numbers, so the person
who frees space resubmits with the same ``run.name`` and the run continues from its newest
checkpoint.
"""
from __future__ import annotations

import errno
from pathlib import Path
from typing import Optional

from recovery import policy
from recovery.commit import abort_save
from recovery.storage import LocalStorage, StorageError, classify

MARGIN = 2.0  # warn when free space is below this many checkpoints


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


def space_warning(root: Path, expected_bytes: Optional[float], *,
                  storage: Optional[LocalStorage] = None) -> Optional[tuple[str, dict]]:
    """(WARNING text, event fields) when the checkpoint filesystem has room for fewer than
    :data:`MARGIN` checkpoints of ``expected_bytes``; None when it has room (or nothing is known)."""
    st = storage or LocalStorage()
    if not expected_bytes or expected_bytes <= 0:
        return None
    probe = Path(root)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = st.free_bytes(probe)
    except OSError:
        return None  # the save itself will tell
    if free >= MARGIN * expected_bytes:
        return None
    fits = "the next save will not fit" if free < expected_bytes else "the save after the next will not fit"
    text = (f"low disk space for checkpoints at {probe}: {_gb(free)} free, one checkpoint is about "
            f"{_gb(expected_bytes)}: {fits}; free space or raise the quota (a save that fails stops the run, "
            f"committed checkpoints are kept)")
    return text, {"path": str(probe), "free_bytes": int(free), "expected_bytes": int(expected_bytes)}


def _free(st: LocalStorage, root: Path) -> Optional[int]:
    probe = Path(root)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return int(st.free_bytes(probe))
    except OSError:
        return None


def save_failed(exc: BaseException, root: Path, step: int, *, storage: Optional[LocalStorage] = None,
                expected_bytes: Optional[float] = None) -> Optional[dict]:
    """Rank 0, after a save failed with ``exc``: remove its staging directory and describe the stop.

    Returns ``{"reason", "code", "detail", **numbers}`` for a storage error (the caller emits
    the ``stop`` event and exits with ``code``), or None when ``exc`` is not a storage error
    (then it is an ordinary crash).

    torch's own file writer loses the errno of a full disk (``[enforce fail at
    inline_container.cc] unexpected pos ...``): an error without one, raised while the
    filesystem has less room than a checkpoint needs (``expected_bytes``), is a full disk too.
    """
    st = storage or LocalStorage()
    err = classify(exc)
    if err is None and expected_bytes:
        free = _free(st, root)
        if free is not None and free < expected_bytes:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            err = StorageError("disk_full", errno.ENOSPC, str(root),
                               f"the save failed ({type(exc).__name__}: {first}) with {free} bytes free, "
                               f"a checkpoint needs about {int(expected_bytes)}")
    if err is None:
        return None
    removed, cleanup = [], ""
    try:
        removed = abort_save(root, step, storage=st)
    except OSError as e:
        cleanup = f"; the staging directory could not be removed ({e})"
    fields: dict = {"path": err.filename, "errno": err.errno_name, "step": step,
                    "removed": [str(p) for p in removed]}
    if err.kind == "disk_full":
        probe = Path(root)
        try:
            fields["free_bytes"] = int(st.free_bytes(probe if probe.exists() else probe.parent))
        except OSError:
            pass
        free = f", {_gb(fields['free_bytes'])} free now" if "free_bytes" in fields else ""
        detail = (f"disk full while saving step {step}: {err}{free}; the torn save was removed{cleanup}, "
                  f"committed checkpoints are untouched. Free space, then resubmit the same run.name")
        return {"reason": "disk_full", "code": policy.EXIT_DISK_FULL, "detail": detail, **fields}
    detail = (f"cannot write the checkpoint of step {step}: {err} (an environment error: permissions, I/O, a "
              f"stale mount){cleanup}; committed checkpoints are untouched. Fix access, then resubmit")
    return {"reason": "storage_error", "code": policy.EXIT_STORAGE, "detail": detail, **fields}




SAVE_POLICIES = ("stop", "retry", "skip")


def judge_failure(policy: str, save_reason: str, in_a_row: int, max_skipped: int) -> tuple[bool, str]:
    """``training.on_save_failure`` on a failed save: (go on?, why), the same for synchronous and asynchronous
    saves. ``in_a_row``: failed periodic saves in a row, this one included (a committed one resets it).

    * a stop save (``signal``) or the final save always stops: it is the last chance to keep the steps;
    * ``stop``: the attempt stops with the failure's own reason and exit code;
    * ``retry``: the next interval saves again (a newer step: the failed one is not kept); a second failure in a
      row stops;
    * ``skip``: a WARNING, up to ``max_skipped`` failures in a row, then stop.
    """
    if save_reason != "interval":
        return False, f"a {save_reason} save always stops on a failure"
    if policy == "retry":
        if in_a_row >= 2:
            return False, "training.on_save_failure=retry: the retry at the next interval failed too"
        return True, "training.on_save_failure=retry: saving again at the next interval"
    if policy == "skip":
        if in_a_row > max_skipped:
            return False, (f"training.on_save_failure=skip: {in_a_row} failed periodic saves in a row > "
                           f"training.max_skipped_saves={max_skipped}")
        return True, (f"training.on_save_failure=skip: skipped ({in_a_row} of training.max_skipped_saves="
                      f"{max_skipped} in a row); the steps since the last committed checkpoint are not durable yet")
    return False, "training.on_save_failure=stop"


__all__ = ["space_warning", "save_failed", "judge_failure", "SAVE_POLICIES", "StorageError", "MARGIN"]


class SaveFailed(RuntimeError):
    """A save the filesystem refused (disk full, EACCES, EIO, ...): every rank stops with ``stop["code"]``.

    Raised by the synchronous and the asynchronous saves of ``train.checkpointer`` alike (``stop`` as
    :func:`save_failed` returns it)."""

    def __init__(self, stop: dict) -> None:
        self.stop = stop
        self.reported = False  # its save_failed event was written (the checkpointer's policy judged it)
        super().__init__(stop["detail"])
