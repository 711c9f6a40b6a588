"""Submit a rendered job with ``sbatch`` and record it in the run directory.

Why we render with submitit but call ``sbatch`` ourselves: a submitit *job* is a pickled
function run by submitit's own process on every task. That process sits between Slurm's
signals and the training ranks: submitit bypasses SIGTERM (a preemption only logs "Bypassing
signal SIGTERM") and calls ``checkpoint()`` on rank 0 only (facebookincubator/submitit#9), while
a Megatron checkpoint needs *all* ranks to agree to stop and to write their shards. So the
script runs ``python -m train.worker RUN_DIR`` directly under srun, every rank installs its
own handler, and this module only needs ``sbatch --parsable``. The runner is injected so the
tests fake Slurm at the subprocess boundary.
"""
from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from launch.config import Job
from launch.paths import RunPaths
from launch.render import render
from recovery.events import read_events

Runner = Callable[..., Any]  # subprocess.run-compatible: runner(argv, capture_output=True, text=True)
SCRIPT_NAME = "sbatch.sh"
SUBMISSIONS_NAME = "submissions.jsonl"
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


def _sbatch(runner: Runner, argv: list[str]) -> Any:
    try:
        proc = runner(argv, capture_output=True, text=True)
    except FileNotFoundError:
        raise SubmitError(f"{argv[0]} is not on PATH: this machine is not a Slurm login node "
                          "(submit from one, or use cluster=local to train here)") from None
    except OSError as exc:
        raise SubmitError(f"cannot run {argv[0]}: {exc.strerror or exc}") from None
    if proc.returncode != 0:
        said = [line.strip() for line in (proc.stderr or proc.stdout or "").splitlines() if line.strip()]
        raise SubmitError(f"{' '.join(argv)} exited {proc.returncode}: {said[-1] if said else '(no output)'}")
    return proc


def _record(run_dir: Path, sub: Submission) -> None:
    with open(run_dir / SUBMISSIONS_NAME, "a") as fh:
        fh.write(json.dumps(asdict(sub), sort_keys=True) + "\n")


def write_script(job: Job, run_dir: str | Path, *, dependency: Optional[str] = None) -> Path:
    """Render and write ``<run_dir>/sbatch.sh``; also create ``logs/`` (sbatch will not)."""
    run_dir = Path(run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    path = run_dir / SCRIPT_NAME
    path.write_text(render(job, run_dir, dependency=dependency))
    return path


def submit(job: Job, run_dir: str | Path, *, runner: Runner = subprocess.run,
           clock: Callable[[], float] = time.time, test_only: bool = False,
           dependency: Optional[str] = None) -> list[Submission]:
    """Write the script, submit it, and pre-submit ``run.dependency_chain`` continuations.

    Returns the submissions in order (first the job, then each ``afterany`` continuation, which
    starts when its predecessor ends for any reason and resumes from the newest checkpoint; a
    continuation that finds the run complete exits 0 at once). With ``test_only``, runs
    ``sbatch --test-only`` (the scheduler checks the script, nothing is queued) and records it.
    """
    run_dir = Path(run_dir)
    try:
        script = write_script(job, run_dir, dependency=dependency)
    except OSError as exc:
        raise SubmitError(f"cannot write {Path(run_dir) / SCRIPT_NAME}: {exc.strerror or exc}") from None
    if test_only:
        proc = _sbatch(runner, ["sbatch", "--test-only", str(script)])
        text = f"{proc.stdout or ''}{proc.stderr or ''}".strip()
        match = _TEST_ONLY.search(text)
        sub = Submission(job_id=None, time=clock(), script=str(script), dependency=dependency, kind="test_only",
                         message=text if match else f"unrecognised --test-only answer: {text}")
        _record(run_dir, sub)
        return [sub]
    proc = _sbatch(runner, ["sbatch", "--parsable", str(script)])
    first = Submission(job_id=parse_job_id(proc.stdout), time=clock(), script=str(script), dependency=dependency)
    _record(run_dir, first)
    subs = [first]
    for _ in range(job.run.dependency_chain):
        dep = f"afterany:{subs[-1].job_id}"
        try:
            proc = _sbatch(runner, ["sbatch", "--parsable", f"--dependency={dep}", str(script)])
        except SubmitError as exc:
            raise SubmitError(str(exc), submitted=subs) from None
        sub = Submission(job_id=parse_job_id(proc.stdout), time=clock(), script=str(script), dependency=dep,
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
        for path in (paths.config, paths.script):
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


def read_submissions(run_dir: str | Path) -> list[dict]:
    """The run's submission records, oldest first (tolerates a torn last line)."""
    return read_events(Path(run_dir) / SUBMISSIONS_NAME)
