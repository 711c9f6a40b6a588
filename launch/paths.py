"""Every file of a run, named once: ``RunPaths``.

Part of the contract both sides read (login node, ranks, recovery, analysis): standard library only.

A run directory ``<cluster.run_root>/<run.name>/`` (or ``run.dir``) holds::

    config.yaml         the composed job (written by the login node, read by every rank)
    sbatch.sh           the batch script as submitted
    submissions.jsonl   one line per sbatch call (job id, time, script hash)
    logs/               one file per rank and attempt, plus the batch script's own log
    events.jsonl        the event log (start, checkpoint, stop, requeue, fallback, ...)
    progress.json       the zero-progress guard's record of attempt start points
    failed_nodes.json   hosts excluded from later attempts
    run.lock            the one-writer lock of a running attempt
    submit.lock         held by pretrain.py from its squeue check to its sbatch record (one submitter)
    stop.json           a drain request (launch/stop.py) and, once honoured, who stopped the run
    hangs/              stack dumps of hung attempts
    tensorboard/        TensorBoard event files (one per attempt; purged past the resumed step)
    wandb_id            the W&B run id every attempt resumes (wandb/ holds W&B's own files)
    data_cache/         Megatron's index cache of an indexed dataset
    checkpoints/        iter_NNNNNNN/ (committed), iter_NNNNNNN.tmp/ (staging), latest

With ``cluster.checkpoint_root`` set, checkpoints live in ``<checkpoint_root>/<run.name>/`` instead, so two runs
that share a checkpoint root never share a checkpoint directory (and the directory the batch script stripes with
``lfs setstripe`` is the one the ranks write).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Union

PathLike = Union[str, Path]

CONFIG = "config.yaml"
SCRIPT = "sbatch.sh"
SUBMISSIONS = "submissions.jsonl"
LOGS = "logs"
EVENTS = "events.jsonl"
PROGRESS = "progress.json"
FAILED_NODES = "failed_nodes.json"
LOCK = "run.lock"
SUBMIT_LOCK = "submit.lock"
STOP_REQUEST = "stop.json"
HANGS = "hangs"
TENSORBOARD = "tensorboard"
WANDB_ID = "wandb_id"
DATA_CACHE = "data_cache"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
STAGING_SUFFIX = ".tmp"


def checkpoint_dir(run_dir: PathLike, run_name: str, checkpoint_root: str = "") -> Path:
    """``<checkpoint_root>/<run_name>`` when a checkpoint root is set, else ``<run_dir>/checkpoints``."""
    if checkpoint_root:
        return Path(checkpoint_root.rstrip("/") or "/") / run_name
    return Path(run_dir) / CHECKPOINTS


@dataclass(frozen=True)
class RunPaths:
    """The files of one run. ``checkpoints`` is resolved once, from ``cluster.checkpoint_root`` and ``run.name``."""

    run_dir: Path
    checkpoints: Path

    @classmethod
    def of(cls, run_dir: PathLike, run_name: str = "", checkpoint_root: str = "") -> "RunPaths":
        run_dir = Path(run_dir)
        return cls(run_dir=run_dir, checkpoints=checkpoint_dir(run_dir, run_name or run_dir.name, checkpoint_root))

    @property
    def config(self) -> Path:
        return self.run_dir / CONFIG

    @property
    def script(self) -> Path:
        return self.run_dir / SCRIPT

    @property
    def submissions(self) -> Path:
        return self.run_dir / SUBMISSIONS

    @property
    def logs(self) -> Path:
        return self.run_dir / LOGS

    @property
    def events(self) -> Path:
        return self.run_dir / EVENTS

    @property
    def progress(self) -> Path:
        return self.run_dir / PROGRESS

    @property
    def failed_nodes(self) -> Path:
        return self.run_dir / FAILED_NODES

    @property
    def lock(self) -> Path:
        return self.run_dir / LOCK

    @property
    def submit_lock(self) -> Path:
        return self.run_dir / SUBMIT_LOCK

    @property
    def stop_request(self) -> Path:
        return self.run_dir / STOP_REQUEST

    @property
    def hangs(self) -> Path:
        return self.run_dir / HANGS

    @property
    def tensorboard(self) -> Path:
        return self.run_dir / TENSORBOARD

    @property
    def wandb_id(self) -> Path:
        return self.run_dir / WANDB_ID

    @property
    def latest(self) -> Path:
        return self.checkpoints / LATEST

    @property
    def data_cache(self) -> Path:
        return self.run_dir / DATA_CACHE

    def checkpoint(self, step: int) -> Path:
        """The committed checkpoint of ``step``."""
        return self.checkpoints / f"iter_{step:07d}"

    def staging(self, step: int) -> Path:
        """Where the ranks write ``step``'s shards before the commit renames it to :meth:`checkpoint`."""
        return self.checkpoints / f"iter_{step:07d}{STAGING_SUFFIX}"

    def rank_log(self, attempt: int, rank: int, prefix: str = "local") -> Path:
        """One rank's output when the ranks run on this machine (``cluster=local``, the tests)."""
        return self.logs / f"{prefix}_{attempt}_rank{rank}.out"
