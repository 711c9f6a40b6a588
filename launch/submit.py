"""Submit a rendered job with ``sbatch`` and record it in the run directory.

Why we render with submitit but call ``sbatch`` ourselves: a submitit *job* is a pickled
function run by submitit's own process on every task. That process sits between Slurm's
signals and the training ranks: submitit bypasses SIGTERM (a preemption only logs "Bypassing
signal SIGTERM") and calls ``checkpoint()`` on rank 0 only (facebookincubator/submitit#9), while
a Megatron checkpoint needs *all* ranks to agree to stop and to write their shards. So the
script runs ``python -m train.worker RUN_DIR`` directly under srun, every rank installs its
own handler, and this module only needs ``sbatch --parsable`` (through
:class:`recovery.slurm.Slurm`). The runner is injected so the tests fake Slurm at the subprocess
boundary.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

from launch.config import Job
from launch.paths import RunPaths
from launch.problems import Problem
from launch.render import render
from recovery import lock
from recovery.events import read_events
from recovery.slurm import Reply, Runner, Slurm, default_runner
_JOB_ID = re.compile(r"^(\d+)(?:_\d+)?(?:;\S+)?$")
_TEST_ONLY = re.compile(r"Job (\d+) to start at (\S+)")


class SubmitError(RuntimeError):
    """sbatch refused the script, is missing, or printed something we cannot read.

    ``submitted`` holds the jobs that were queued before the failure (a dependency chain that
    broke half-way); empty means nothing was queued.
    """

    def __init__(self, message: str, submitted: Optional[list["Submission"]] = None):
        super().__init__(message)
        self.submitted = list(submitted or [])


@dataclass
class Submission:
    """One sbatch call, as appended to ``<run_dir>/submissions.jsonl``."""

    job_id: Optional[str]  # None for --test-only
    time: float  # unix seconds (injected clock)
    script: str  # path of the submitted script
    dependency: Optional[str] = None  # e.g. afterany:123 for a continuation
    kind: str = "submit"  # submit | continuation | test_only
    message: str = ""  # sbatch's own words for --test-only (expected start, nodes)


def parse_job_id(stdout: str) -> str:
    """``sbatch --parsable`` prints ``<id>`` or ``<id>;<cluster>``."""
    line = stdout.strip().splitlines()[-1].strip() if stdout.strip() else ""
    match = _JOB_ID.match(line)
    if not match:
        raise SubmitError(f"cannot read a job id from sbatch output {stdout!r}")
    return match.group(1)


def sbatch(slurm: Slurm, script: Path, *options: str) -> Reply:
    """``sbatch <options> <script>``; a refusal or a missing sbatch is a :class:`SubmitError` in one line."""
    r = slurm.sbatch(str(script), *options)
    if isinstance(r.error, FileNotFoundError):
        raise SubmitError("sbatch is not on PATH: this machine is not a Slurm login node "
                          "(submit from one, or use cluster=local to train here)")
    if isinstance(r.error, OSError):
        raise SubmitError(f"cannot run sbatch: {r.error.strerror or r.error}")
    if not r.ok:
        said = [line.strip() for line in (r.err or r.out).splitlines() if line.strip()]
        raise SubmitError(f"{' '.join(r.argv)} exited {r.rc}: {said[-1] if said else '(no output)'}")
    return r


def _record(run_dir: Path, sub: Submission) -> None:
    with open(RunPaths.of(run_dir).submissions, "a") as fh:
        fh.write(json.dumps(asdict(sub), sort_keys=True) + "\n")


def write_script(job: Job, run_dir: str | Path, *, dependency: Optional[str] = None) -> Path:
    """Render and write ``<run_dir>/sbatch.sh``; also create ``logs/`` (sbatch will not)."""
    paths = RunPaths.of(run_dir)
    paths.logs.mkdir(parents=True, exist_ok=True)
    path = paths.script
    path.write_text(render(job, run_dir, dependency=dependency))
    return path


def submit(job: Job, run_dir: str | Path, *, runner: Runner = default_runner,
           clock: Callable[[], float] = time.time, test_only: bool = False,
           dependency: Optional[str] = None) -> list[Submission]:
    """Write the script, submit it, and pre-submit ``run.dependency_chain`` continuations.

    Returns the submissions in order (first the job, then each ``afterany`` continuation, which
    starts when its predecessor ends for any reason and resumes from the newest checkpoint; a
    continuation that finds the run complete exits 0 at once). With ``test_only``, runs
    ``sbatch --test-only`` (the scheduler checks the script, nothing is queued) and records it.
    """
    run_dir = Path(run_dir)
    slurm = Slurm(runner)
    try:
        script = write_script(job, run_dir, dependency=dependency)
    except OSError as exc:
        raise SubmitError(f"cannot write {RunPaths.of(run_dir).script}: {exc.strerror or exc}") from None
    if test_only:
        r = sbatch(slurm, script, "--test-only")
        text = f"{r.out}{r.err}".strip()
        match = _TEST_ONLY.search(text)
        sub = Submission(job_id=None, time=clock(), script=str(script), dependency=dependency, kind="test_only",
                         message=text if match else f"unrecognised --test-only answer: {text}")
        _record(run_dir, sub)
        return [sub]
    r = sbatch(slurm, script, "--parsable")
    first = Submission(job_id=parse_job_id(r.out), time=clock(), script=str(script), dependency=dependency)
    _record(run_dir, first)
    subs = [first]
    for _ in range(job.run.dependency_chain):
        dep = f"afterany:{subs[-1].job_id}"
        try:
            r = sbatch(slurm, script, "--parsable", f"--dependency={dep}")
        except SubmitError as exc:
            raise SubmitError(str(exc), submitted=subs) from None
        sub = Submission(job_id=parse_job_id(r.out), time=clock(), script=str(script), dependency=dep,
                         kind="continuation")
        _record(run_dir, sub)
        subs.append(sub)
    return subs


@dataclass
class RunDirSnapshot:
    """The files a submission writes, as they were before it: a submission that did not happen
    puts them back (removes what it created, restores what it overwrote), so a failed ``sbatch``
    leaves no half-made run behind (whose config.yaml would later refuse another model)."""

    run_dir: Path
    created_from: Optional[Path]  # the topmost directory this submission will create (None: it exists)
    files: dict  # path -> previous bytes, or None when the file did not exist
    logs_existed: bool

    @classmethod
    def take(cls, run_dir: str | Path) -> "RunDirSnapshot":
        paths = RunPaths.of(run_dir)
        created, probe = None, Path(run_dir).absolute()
        while not probe.exists() and probe != probe.parent:
            created, probe = probe, probe.parent
        files = {}
        for path in (paths.config, paths.script, paths.stop_request, paths.memory_plan):
            try:
                files[path] = path.read_bytes() if path.exists() else None
            except OSError:
                files[path] = None
        return cls(Path(run_dir).absolute(), created, files, paths.logs.exists())

    def restore(self) -> None:
        """Undo the submission's writes; never touches a file the submission did not write."""
        for path, data in self.files.items():
            try:
                if data is None:
                    path.unlink(missing_ok=True)
                else:
                    path.write_bytes(data)
            except OSError:
                pass
        dirs = [] if self.logs_existed else [RunPaths.of(self.run_dir).logs]
        if self.created_from is not None:
            probe = self.run_dir
            while True:
                dirs.append(probe)
                if probe == self.created_from or probe == probe.parent:
                    break
                probe = probe.parent
        for d in dirs:
            try:
                d.rmdir()  # only if empty
            except OSError:
                pass


class SubmitLock:
    """One submitter per run: ``<run_dir>/submit.lock`` (:attr:`RunPaths.submit_lock`), held from the squeue
    check to the ``submissions.jsonl`` record of the sbatch, so two ``pretrain.py`` of one run started at the same
    moment cannot both find the queue empty and both submit: the second is refused in one line, and a third that
    comes after the first finished sees its job in squeue. The lock is the run lock's atomic record
    (:mod:`recovery.lock`: ``link(2)``, holder host/pid; a dead pretrain.py's record is stale on its own host).
    :meth:`take` returns ``(lock, None)`` or ``(None, problem)``; :meth:`release` removes the record and the run
    directory again when taking the lock created it and nothing else was written."""

    def __init__(self, acquired, created: list[Path]):
        self.acquired, self.created = acquired, created

    @classmethod
    def take(cls, run_dir: str | Path) -> tuple[Optional["SubmitLock"], Optional[Problem]]:
        paths = RunPaths.of(run_dir)
        created, probe = [], Path(run_dir).absolute()
        while not probe.exists() and probe != probe.parent:
            created.append(probe)
            probe = probe.parent
        try:
            acquired = lock.acquire(paths.submit_lock, lock.me_from_env({}))
        except lock.RunLocked as exc:
            return None, Problem("run.name", "another pretrain.py is submitting this run right now (one submitter "
                                 "per run)", f"{paths.submit_lock}: held by {exc.holder.describe()} ({exc.why})",
                                 "wait a few seconds and look at squeue (its job is this run's writer), or pick "
                                 f"another run.name; if no pretrain.py of it runs, remove {paths.submit_lock}")
        except OSError as exc:
            return None, Problem("run.dir", f"cannot write the run directory {Path(run_dir).absolute()}: "
                                 f"{exc.strerror or exc}", f"creating {paths.submit_lock.name} failed",
                                 "set cluster.run_root=<a writable directory> (or run.dir=...)")
        return cls(acquired, created), None

    def release(self) -> None:
        self.acquired.release()
        for d in self.created:  # innermost first; only the empty ones (a refused submission wrote nothing)
            try:
                d.rmdir()
            except OSError:
                break


def read_submissions(run_dir: str | Path) -> list[dict]:
    """The run's submission records, oldest first (tolerates a torn last line)."""
    return read_events(RunPaths.of(run_dir).submissions)
