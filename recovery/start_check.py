"""What a run's newest verified checkpoint says about a new launch, before any rank starts.

Two questions are answered from the checkpoint's manifest (``meta``, written by the worker) and
the job alone, so the login node (``launch/pretrain.py``: the check before a Slurm submission,
and the local launcher's start) and the ranks (``train/checkpointer.py``) give the same answer:

* :func:`optimizer_conflict`: can this job load the checkpoint at all? A change of layout (TP,
  PP, DP) is not a conflict: dist-checkpointing reshards model and optimizer state. A change of
  optimizer type (``parallelism.distributed_optimizer``) is: the two optimizer states cannot be
  converted into each other. The refusal is final (exit 15, ``checkpoint_mismatch``).
* :func:`complete_line`: is there nothing left to train (the checkpoint's step reached the
  target)? Then the launch ends at once, without starting ranks.

No torch here (login side); the job is read duck-typed (``job.parallelism``, ``job.iterations``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from recovery.commit import manifest_of, verify
from recovery.identity import model_shape
from recovery.resume import Resume, candidates_of, find_latest_verified, owner_problem
from recovery.storage import LocalStorage, StorageError

# A final checkpoint up to this size is re-hashed on the login node before it is called complete;
# a bigger one is judged by its manifest and file sizes (the ranks re-hash what they load).
DEEP_VERIFY_MAX_BYTES = 8 * 2**30

_KIND = {True: "the distributed optimizer", False: "the ordinary optimizer"}


@dataclass(frozen=True)
class Conflict:
    """A checkpoint this job cannot load: the field, what differs, and the fix (one line: :attr:`line`)."""

    field: str
    message: str
    arithmetic: str
    fix: str

    @property
    def line(self) -> str:
        return f"{self.field}: {self.message} ({self.arithmetic}). Fix: {self.fix}"


def optimizer_conflict(meta: dict, distributed_optimizer: bool, path: Any) -> Optional[Conflict]:
    """Why the checkpoint at ``path`` (its manifest's ``meta``) cannot be loaded with
    ``parallelism.distributed_optimizer=distributed_optimizer``, with the fix; None when it can."""
    saved = (meta or {}).get("distributed_optimizer")
    if saved is None or bool(saved) == bool(distributed_optimizer):
        return None
    return Conflict(
        "parallelism.distributed_optimizer",
        f"the run's checkpoint was written by {_KIND[bool(saved)]} and this job uses "
        f"{_KIND[bool(distributed_optimizer)]}; their optimizer states cannot be converted into each other "
        f"(a change of tp/pp/dp alone is resharded on load)",
        f"{path}: distributed_optimizer={bool(saved)}, layout {_layout((meta or {}).get('layout'))}; "
        f"this job: distributed_optimizer={bool(distributed_optimizer)}",
        f"add parallelism.distributed_optimizer={bool(saved)} to continue this run, or run.name=NEW to start another")


def _layout(layout: Any) -> str:
    """``tp2-pp1-dp2`` from the manifest's layout (a dict of sizes), as the job's layout label reads."""
    if not isinstance(layout, dict):
        return str(layout or "?")
    parts = [f"{k}{layout[k]}" for k in ("tp", "pp", "vpp", "cp", "ep", "dp")
             if layout.get(k) is not None and (k in ("tp", "pp", "dp") or layout[k] not in (0, 1))]
    return "-".join(parts)


def complete_line(step: int, target: int, run_name: str) -> str:
    """The one line of a launch of a run that has nothing left to train."""
    return (f"run {run_name} is already complete at step {step}/{target}; nothing to train, no rank started. "
            f"Raise training.train_iters (or training.train_tokens) to train on, or run.name=NEW to start another")


@dataclass
class Verdict:
    """What the newest checkpoint means for a launch of ``job``: a ``conflict`` (refuse; on the ranks exit 15),
    ``complete`` (end at once, exit 0), or neither (start the ranks)."""

    resume: Resume
    conflict: Optional[Conflict] = None
    complete: Optional[str] = None
    notes: list = field(default_factory=list)


def _bytes(path: Path, st: LocalStorage) -> int:
    files = (manifest_of(path, storage=st).get("files") or {})
    return sum(int(f.get("size", 0)) if isinstance(f, dict) else 0 for f in files.values())


def judge(job: Any, checkpoints: Path, run_id: Optional[str], *, storage: Optional[LocalStorage] = None) -> Verdict:
    """The login side's view of the run's newest checkpoint (nothing is written).

    The checkpoint is found as the ranks find it (newest first, a candidate that fails is passed
    over), checked by manifest and sizes; the one a launch would end on as complete is re-hashed
    too when it is small enough (:data:`DEEP_VERIFY_MAX_BYTES`). A checkpoint of another run (a
    name, id or model shape the manifest does not share) is left to the ranks' own refusal."""
    st = storage or LocalStorage()
    checkpoints = Path(checkpoints)
    try:
        if not st.is_dir(checkpoints) or not candidates_of(checkpoints, storage=st):
            return Verdict(Resume(None, None))
        res = find_latest_verified(checkpoints, storage=st, deep=False)
    except (StorageError, OSError) as exc:  # the ranks meet it and stop with its own exit code
        return Verdict(Resume(None, None), notes=[f"cannot read {checkpoints} ({exc}); the ranks will judge it"])
    if res.path is None:
        return Verdict(res)
    identity = {"name": job.run.name, "id": run_id, "model": model_shape(job.model)}
    if owner_problem(res.owner, identity, res.meta):
        return Verdict(res)
    conflict = optimizer_conflict(res.meta, bool(job.parallelism.distributed_optimizer), res.path)
    if conflict:
        return Verdict(res, conflict=conflict)
    target = job.iterations
    if target and res.step is not None and res.step >= int(target):
        try:
            deep = _bytes(res.path, st) <= DEEP_VERIFY_MAX_BYTES
            if deep and verify(res.path, storage=st, deep=True) is not None:
                return Verdict(res)  # it will not load: the ranks fall back past it, with a WARNING
        except (StorageError, OSError):
            return Verdict(res)
        return Verdict(res, complete=complete_line(res.step, int(target), job.run.name))
    return Verdict(res)
