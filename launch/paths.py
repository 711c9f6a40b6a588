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
    memory_plan.json    the planner's per-GPU memory estimate of the submitted layout (its terms and fixes)
    local_plan.json     the planner's space arithmetic of the node-local tier (when it is on): what a node needs
    oom/                out-of-memory forensics: memory_summary / snapshot per rank and attempt
    startup/            start-up failures: one JSON record per attempt and failing rank (recovery/startup_failures.py)
    run_id              the run's identity, written into every manifest (recovery/identity.py)
    preflight/          the preflight job's own run: its config.yaml, options.json, logs, checkpoint
    preflight.json      the preflight's verdict
    checkpoints/        iter_NNNNNNN/ (committed), iter_NNNNNNN.tmp/ (staging), latest, quarantine/;
                        iter_NNNNNNN.old (set aside by a commit of the same step), iter_NNNNNNN.del (being pruned)

With ``cluster.checkpoint_root`` set, checkpoints live in ``<checkpoint_root>/<run.name>/`` instead, so two runs
that share a checkpoint root never share a checkpoint directory (and the directory the batch script stripes with
``lfs setstripe`` is the one the ranks write).
"""
from __future__ import annotations

import os
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

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
MEMORY_PLAN = "memory_plan.json"
LOCAL_PLAN = "local_plan.json"
OOM = "oom"
STARTUP = "startup"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
RUN_ID = "run_id"
PREFLIGHT_DIR = "preflight"  # <run_dir>/preflight/: the preflight job's own config, logs, checkpoint
PREFLIGHT_REPORT = "preflight.json"
PREFLIGHT_OPTIONS = "options.json"  # in the preflight directory, beside its config.yaml
HANG_SUMMARY = "summary.json"  # in each hangs/<attempt>/ directory
QUARANTINE = "quarantine"  # under the checkpoint directory: never a checkpoint name, never loaded nor pruned

# Checkpoint directory names: iter_NNNNNNN (committed) and its suffixed states.
CHECKPOINT_PREFIX = "iter_"
CHECKPOINT_DIGITS = 7
STAGING_SUFFIX = ".tmp"  # being written by the ranks
ASIDE_SUFFIX = ".old"  # set aside by a commit of the same step
DELETE_SUFFIX = ".del"  # being deleted by the prune: garbage, never a candidate
def _step_name(prefix: str, suffixes: tuple[str, ...]) -> re.Pattern:
    """``<prefix><step, CHECKPOINT_DIGITS or more digits>[one of suffixes]``: a step directory's name."""
    return re.compile(rf"^{prefix}(\d{{{CHECKPOINT_DIGITS},}})({'|'.join(re.escape(x) for x in suffixes)})?$")


def _parse_step_name(pattern: re.Pattern, name: str) -> Optional[tuple[int, str]]:
    m = pattern.match(name)
    return (int(m.group(1)), m.group(2) or "") if m else None


_CHECKPOINT_NAME = _step_name(CHECKPOINT_PREFIX, (STAGING_SUFFIX, ASIDE_SUFFIX, DELETE_SUFFIX))


def checkpoint_name(step: int) -> str:
    """``iter_0000010`` for step 10: the name of a committed checkpoint directory."""
    return f"{CHECKPOINT_PREFIX}{int(step):0{CHECKPOINT_DIGITS}d}"


def parse_checkpoint_name(name: str) -> Optional[tuple[int, str]]:
    """``iter_0000010`` -> (10, ''), ``iter_0000010.tmp`` -> (10, '.tmp'); None for any other name."""
    return _parse_step_name(_CHECKPOINT_NAME, name)


NAME_MAX = 255  # bytes in one path component on Linux filesystems (ext4, xfs, Lustre, NFS)
NAME_FIX = "set run.name=<at most 255 bytes of letters, digits, - _ .> (no '/', '..', '%' or control characters)"


class RunDirError(ValueError):
    """A run name, run root or run directory that no entry point accepts; ``str()`` is one line with the fix."""


def _control(text: str) -> Optional[str]:
    """The first control character of ``text`` (C0, DEL, C1, or a Unicode format/line separator), as ``repr``."""
    for ch in text:
        if ord(ch) < 32 or 127 <= ord(ch) < 160 or unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
            return repr(ch) + (" (a newline)" if ch in "\n\r" else "")
    return None


def run_name_issue(name: object) -> Optional[tuple[str, str]]:
    """Why ``name`` cannot name a run directory (``None``: it can), in one line: what, the arithmetic, the fix.

    The one rule every entry point applies (``pretrain``, ``status``, ``stop``, ``plan``, ``preflight``,
    ``report``, the resume inspector). The length is checked first, so a name too long for the
    filesystem is this line and never an ``OSError`` of a later path operation. ``%`` is refused because
    Slurm expands it in ``--output`` paths but not in the run directory, so the logs would land elsewhere.
    """
    if not isinstance(name, str):
        return f"run.name = {name!r} is not a string", NAME_FIX
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > NAME_MAX:
        return (f"run.name is {size} bytes ({len(name)} characters) > NAME_MAX {NAME_MAX}, too long for a directory "
                "name", f"use a run.name of at most {NAME_MAX} bytes")
    bad = _control(name)
    if bad:
        why = f"contains the control character {bad}"
    elif not name.strip():
        why = "is empty"
    elif "/" in name:
        why = "contains '/' (a run is one directory under cluster.run_root)"
    elif ".." in name or name == ".":
        why = "contains '..' or is '.' (it would name a directory outside cluster.run_root)"
    elif "%" in name:
        why = "contains '%' (Slurm expands it in the log paths, not in the run directory: the logs would land elsewhere)"
    else:
        return None
    return f"run.name = {name!r} {why}", NAME_FIX


def run_root_issue(run_root: object) -> Optional[tuple[str, str]]:
    """Why ``cluster.run_root`` cannot hold runs (``None``: it can): empty, blank, a control character or ``%``."""
    if not isinstance(run_root, str) or not run_root.strip():
        return (f"cluster.run_root = {run_root!r} is empty: the run would land at the filesystem root",
                "set cluster.run_root=runs (or the shared directory of your runs)")
    if resolved(run_root) == Path("/"):
        return (f"cluster.run_root = {run_root!r} is the filesystem root",
                "set cluster.run_root=runs (or the shared directory of your runs)")
    bad = _control(run_root)
    if bad:
        return f"cluster.run_root = {run_root!r} contains the control character {bad}", "remove it"
    if "%" in run_root:
        return (f"cluster.run_root = {run_root!r} contains '%' (Slurm expands it in the log paths, not in the run "
                "directory)", "choose a directory without '%'")
    return None


# directories that hold a system or every user's files: a run (or a node-local tier) never takes one over
SYSTEM_DIRS = frozenset(Path(p) for p in ("/", "/bin", "/boot", "/dev", "/dev/shm", "/etc", "/home", "/lib", "/lib64",
                                          "/media", "/mnt", "/opt", "/proc", "/root", "/run", "/sbin", "/srv", "/sys",
                                          "/tmp", "/usr", "/var", "/var/tmp", "/scratch"))


def system_dir_issue(path: str, field: str) -> Optional[str]:
    """Why ``path`` may not be a run's own directory: it resolves to ``/``, a system directory or a home directory."""
    where = resolved(path)
    if where in SYSTEM_DIRS or where == resolved("~") or where.parent == Path("/home"):
        shown = "" if str(where) == path else f", which resolves to {where}"
        return f"{field} = {path!r}{shown}, a system or shared directory, not a directory of its own"
    return None


def run_dir_issue(run_dir: object, field: str = "run.dir") -> Optional[tuple[str, str]]:
    """Why an explicit run directory (``run.dir`` or a path on the command line) is refused (``None``: it is not)."""
    if not isinstance(run_dir, str) or not run_dir.strip():
        return f"{field} = {run_dir!r} is empty", "give the run directory (e.g. runs/NAME)"
    bad = _control(run_dir)
    if bad:
        return f"{field} = {run_dir!r} contains the control character {bad}", "remove it"
    system = system_dir_issue(run_dir, field)
    if system:
        return system, "give the run a directory of its own (e.g. runs/NAME)"
    if "%" in run_dir:
        return (f"{field} = {run_dir!r} contains '%' (Slurm expands it in the log paths, not in the run directory)",
                "choose a directory without '%'")
    too_long = [part for part in run_dir.split("/") if len(part.encode("utf-8", "surrogatepass")) > NAME_MAX]
    if too_long:
        return (f"{field}: the path component {too_long[0][:40]!r}... is {len(too_long[0].encode('utf-8', 'surrogatepass'))}"
                f" bytes > NAME_MAX {NAME_MAX}", "use shorter directory names")
    return None


def _line(issue: Optional[tuple[str, str]]) -> Optional[str]:
    return f"{issue[0]}; fix: {issue[1]}" if issue else None


def run_name_problem(name: object) -> Optional[str]:
    """:func:`run_name_issue` as one line (what; fix), or None."""
    return _line(run_name_issue(name))


def run_root_problem(run_root: object) -> Optional[str]:
    """:func:`run_root_issue` as one line (what; fix), or None."""
    return _line(run_root_issue(run_root))


def run_dir_problem(run_dir: object, field: str = "run.dir") -> Optional[str]:
    """:func:`run_dir_issue` as one line (what; fix), or None."""
    return _line(run_dir_issue(run_dir, field))


def run_dir_for(run_root: str, name: str, run_dir: str = "") -> Path:
    """The run directory a job names (``run.dir``, else ``<run_root>/<name>``), absolute and resolved.

    Raises :class:`RunDirError` (one line) for a name, root or directory the rule refuses. With ``run.dir``
    set, ``run.name`` still names the checkpoints under a checkpoint root, so it must pass the rule too.
    """
    problem = run_name_problem(name) or (run_dir_problem(run_dir) if run_dir else run_root_problem(run_root))
    if problem:
        raise RunDirError(problem)
    return resolved(run_dir or os.path.join(run_root, name))


def given_run_dir(arg: str, what: str = "run directory") -> Path:
    """A run directory given on the command line, resolved (``..`` and symlinks followed), so it can be shown.

    Raises :class:`RunDirError` for an empty path, a control character, ``%`` or a component too long.
    """
    problem = run_dir_problem(arg, what)
    if problem:
        raise RunDirError(problem)
    return resolved(arg)


def unwritable_ancestor(path: PathLike) -> Optional[str]:
    """Why nothing can be created at or below ``path``, judged at its nearest existing ancestor (``path`` itself when
    it exists): not a directory, not writable by this user, or on a read-only filesystem. None when it can."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    try:
        if os.statvfs(probe).f_flag & os.ST_RDONLY:  # root passes os.access even there
            return f"{probe} is on a read-only filesystem"
    except OSError:
        pass
    return None


def resolved(path: PathLike) -> Path:
    """``path`` made absolute with ``..`` and symlinks resolved as far as it exists (never raises for a missing one)."""
    try:
        return Path(os.path.realpath(os.path.expanduser(str(path))))
    except (OSError, ValueError):
        return Path(os.path.abspath(str(path)))


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

    @property
    def memory_plan(self) -> Path:
        return self.run_dir / MEMORY_PLAN

    @property
    def local_plan(self) -> Path:
        return self.run_dir / LOCAL_PLAN

    def oom(self, job_id: Optional[str], attempt: int, rank: int, what: str) -> Path:
        """One rank's out-of-memory forensics: ``oom/<job or local>_<attempt>_rank<R>.<what>``
        (``what``: ``memory_summary.txt`` or ``snapshot.pickle``)."""
        return self.run_dir / OOM / f"{job_id or 'local'}_{attempt}_rank{rank}.{what}"

    @property
    def startup(self) -> Path:
        """Start-up failures, one record per attempt and failing rank (:mod:`recovery.startup_failures`)."""
        return self.run_dir / STARTUP

    def startup_failure(self, job_id: Optional[str], attempt: int, rank: int) -> Path:
        """One rank's start-up failure: ``startup/<job or local>_<attempt>_rank<R>.json``."""
        return self.startup / f"{job_id or 'local'}_{int(attempt)}_rank{int(rank)}.json"

    @property
    def run_id(self) -> Path:
        return self.run_dir / RUN_ID

    @property
    def preflight_dir(self) -> Path:
        return self.run_dir / PREFLIGHT_DIR

    @property
    def preflight_report(self) -> Path:
        return self.run_dir / PREFLIGHT_REPORT

    @property
    def preflight_options(self) -> Path:
        """The preflight job's options; this run directory is the preflight directory itself."""
        return self.run_dir / PREFLIGHT_OPTIONS

    @property
    def quarantine(self) -> Path:
        return self.checkpoints / QUARANTINE

    def checkpoint(self, step: int) -> Path:
        """The committed checkpoint of ``step``."""
        return self.checkpoints / checkpoint_name(step)

    def staging(self, step: int) -> Path:
        """Where the ranks write ``step``'s shards before the commit renames it to :meth:`checkpoint`."""
        return self.checkpoints / (checkpoint_name(step) + STAGING_SUFFIX)

    def rank_log(self, attempt: int, rank: int, prefix: str = "local") -> Path:
        """One rank's output when the ranks run on this machine (``cluster=local``, the tests)."""
        return self.logs / f"{prefix}_{attempt}_rank{rank}.out"


# ---- the node-local checkpoint tier (training.local_checkpoint) ---------------------------------------------
# <cluster.local_checkpoint_dir>/<node>/<run.name>/local_NNNNNNN/   a committed local set held by <node>:
#     manifest.json                       run identity, step, world, layout, the nodes and their ranks, SHA-256s
#     <owner node>/rank_NNNNN.safetensors one rank's tensors (its own node's, and the replicas of the previous
#     <owner node>/rank_NNNNN.json        node(s) of the ring), and its JSON state (step, data position, scheduler)
# local_NNNNNNN.tmp (being written), local_NNNNNNN.del (being pruned): never loaded.
LOCAL_SET_PREFIX = "local_"
MANIFEST = "manifest.json"  # in every committed checkpoint (recovery/commit.py) and local set
LOCAL_MANIFEST = MANIFEST
_LOCAL_SET_NAME = _step_name(LOCAL_SET_PREFIX, (STAGING_SUFFIX, DELETE_SUFFIX))


def local_set_name(step: int) -> str:
    """``local_0000012``: a committed local set of step 12."""
    return f"{LOCAL_SET_PREFIX}{int(step):0{CHECKPOINT_DIGITS}d}"


def parse_local_set_name(name: str) -> Optional[tuple[int, str]]:
    """``local_0000012`` -> (12, ''), ``local_0000012.tmp`` -> (12, '.tmp'); None for any other name."""
    return _parse_step_name(_LOCAL_SET_NAME, name)


@dataclass(frozen=True)
class LocalPaths:
    """The files of one run's local tier on one node: ``<local_checkpoint_dir>/<node>/<run.name>/``.

    With ``cluster=local`` every simulated node's directory is on this machine; on Slurm ``<local_checkpoint_dir>``
    is node-local, and the ``<node>`` level keeps a misconfigured shared path from mixing nodes."""

    root: Path  # cluster.local_checkpoint_dir
    run_name: str

    def node_dir(self, node: str) -> Path:
        return self.root / node / self.run_name

    def set_dir(self, node: str, step: int) -> Path:
        return self.node_dir(node) / local_set_name(step)

    def staging(self, node: str, step: int) -> Path:
        return self.node_dir(node) / (local_set_name(step) + STAGING_SUFFIX)

    @staticmethod
    def shard_files(owner: str, rank: int) -> tuple[str, str]:
        """A rank's two files inside a set, relative to it: tensors (safetensors) and JSON state."""
        return f"{owner}/rank_{int(rank):05d}.safetensors", f"{owner}/rank_{int(rank):05d}.json"
